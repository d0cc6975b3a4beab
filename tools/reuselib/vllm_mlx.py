"""vllm-mlx, a second peer: its own venv, how it is started, and its cached tokens.

vllm-mlx 0.6.0 pins mlx-lm < 0.32, so it runs from ``.venv-vllm-mlx`` (``make
vllm-mlx``), not from the project's venv. Started as

    .venv-vllm-mlx/bin/python -m vllm_mlx.cli serve MODEL --continuous-batching
        --cache-memory-mb N --host 127.0.0.1 --port P

with ``HOME`` set to a directory of the run: it saves its prefix cache under
``$HOME/.cache/vllm-mlx`` on shutdown and loads it at start, so a shared HOME
would start the next run warm. Without ``--continuous-batching`` a plain chat
completion never reaches its prefix cache. What differs from mlx-lm's server,
as ``VllmMlxServer`` declares through ``Server``'s hooks:

- a request without ``"model": MODEL`` is refused (HTTP 422);
- ``usage`` has no ``prompt_tokens_details``: the prompt tokens a request
  reused are only in its log (``ScheduleLog``). Its ``[cache_fetch] HIT``
  lines and ``/v1/cache/stats`` count more: an exact repeat is fetched whole,
  then thrown away and prefilled in full;
- its stream opens with a ``{"role": "assistant"}`` chunk before any prefill
  (``servers.carries_output``);
- it exits -15 on SIGTERM after a clean shutdown.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

from .servers import Server

VENV = Path(__file__).resolve().parents[2] / ".venv-vllm-mlx"
PYTHON = VENV / "bin" / "python"
BUILD = "make vllm-mlx"
# More than the whole trace's K/V on every tiny arch (llama: 512 B a token, about
# 20k prompt tokens a run: 10 MiB), so it never evicts, like mlx-lm's default prompt
# cache, which has no byte cap (10 entries). Its own default is 20% of the RAM.
CACHE_MB = 64
# one line per request the scheduler takes, written before its prefill:
#   [schedule] request=463f2b86-628 uid=0 prompt_tokens=712 tokens_to_prefill=25, 687 cached ...
SCHEDULE = re.compile(
    rb"\[schedule\] request=(\S+) uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)[, ]"
)


def available() -> bool:
    return PYTHON.exists()


def versions() -> dict[str, str]:
    """vllm-mlx's, mlx-lm's and mlx's versions in its venv (empty without the venv)."""
    paths = [str(p) for p in VENV.glob("lib/python*/site-packages")]
    found = {
        d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions(path=paths)
    }
    return {k: found[k] for k in ("vllm-mlx", "mlx-lm", "mlx") if k in found}


def argv(model: Path, cache_mb: int | None) -> list[str]:
    """The command line that serves ``model`` with a ``cache_mb`` prefix cache, or with
    none (``None``: the cache-less twin, same batching)."""
    serve = [str(PYTHON), "-m", "vllm_mlx.cli", "serve", str(model), "--continuous-batching"]
    if cache_mb is None:
        return [*serve, "--disable-prefix-cache"]
    return [*serve, "--cache-memory-mb", str(cache_mb)]


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One ``[schedule]`` line: where it starts in the log, and its counts."""

    offset: int
    request: str  # vllm-mlx's request id, cut to 12 characters; not in the reply
    prompt_tokens: int
    tokens_to_prefill: int

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.tokens_to_prefill


def scheduled(log: bytes) -> list[Scheduled]:
    """Every complete ``[schedule]`` line of ``log``, in order."""
    done = log[: log.rfind(b"\n") + 1]  # a line still being written is left for later
    return [
        Scheduled(m.start(), m[1].decode(), int(m[2]), int(m[3])) for m in SCHEDULE.finditer(done)
    ]


class ScheduleLog:
    """Gives each reply of a vllm-mlx server the ``[schedule]`` line of its request.

    The reply does not name the line: its ``id`` (``chatcmpl-…``) is not the
    scheduler's request id. So a reply claims the first line not yet claimed
    that (1) starts at or after ``log_offset``, the log's size when its request
    was sent, and (2) has the reply's ``usage.prompt_tokens``. A request's line
    is written before its prefill, so it is in the log when the reply comes.
    One request at a time, this is exact: the only new line is its own. With
    requests in flight together, a line is only taken by a request sent before
    it was written with the same prompt length; two such requests (the same
    prompt length, in flight together) may swap their counts, which leaves any
    total unchanged.

    >>> import tempfile
    >>> log = Path(tempfile.mkdtemp()) / "vllm-mlx.log"
    >>> _ = log.write_bytes(b"[schedule] request=a uid=0 prompt_tokens=712 tokens_to_prefill=712 "
    ...                     b"max_tokens=8\\n")
    >>> ScheduleLog(log).claim(0, 712).cached_tokens
    0
    """

    def __init__(self, path: Path):
        self.path = path
        self._claimed: set[int] = set()  # offsets of the lines already given to a reply
        self._lock = threading.Lock()  # the concurrent clients' threads claim at once

    def claim(self, log_offset: int, prompt_tokens: int) -> Scheduled:
        """The line of the request sent when the log was ``log_offset`` bytes long.

        Raises:
            LookupError: no unclaimed line of ``prompt_tokens`` tokens since then.
        """
        with self._lock:
            for line in scheduled(self.path.read_bytes()):
                fits = line.offset >= log_offset and line.prompt_tokens == prompt_tokens
                if fits and line.offset not in self._claimed:
                    self._claimed.add(line.offset)
                    return line
        raise LookupError(
            f"no [schedule] line with prompt_tokens={prompt_tokens} after byte {log_offset} "
            f"of {self.path}"
        )


class VllmMlxServer(Server):
    """vllm-mlx serving ``model`` (``cache_mb``: see ``argv``), its log in
    ``workdir / f"{name}.log"``, its HOME ``workdir / f"{name}-home"`` (emptied
    first unless ``keep``: the prefix cache it saved at its last exit is loaded)."""

    def __init__(
        self, name: str, model: Path, workdir: Path, cache_mb: int | None, *, keep: bool = False
    ):
        home = workdir / f"{name}-home"
        if not keep:  # a kept --workdir: start cold (``keep``: a restart, with what it saved)
            shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True, exist_ok=True)
        self.model = str(model)
        log = workdir / f"{name}.log"
        # the model is a local directory: nothing to ask the Hub
        env = {"HOME": str(home), "HF_HUB_OFFLINE": "1"}
        super().__init__(name, argv(model, cache_mb), log, env=env)
        self.schedule = ScheduleLog(log)

    def request_fields(self) -> dict[str, object]:
        return {"model": self.model}

    def cached_tokens(self, usage: Mapping[str, Any], log_offset: int) -> int:
        return self.schedule.claim(log_offset, usage["prompt_tokens"]).cached_tokens
