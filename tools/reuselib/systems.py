"""The servers compared by tools/bench_reuse_serve.py, and how each is started.

``mlx-lm``    plain ``mlx_lm.server`` (its LRUPromptCache, default settings)
``vllm-mlx``  vllm-mlx's server from its own venv (tools/reuselib/vllm_mlx.py),
              continuous batching, prefix cache of ``Launch.vllm_mlx_cache_mb``
``ours``      ``prefixcache serve`` with the hot and SSD tiers (SSD in a temp dir)
``none``      ``mlx_lm.server --prompt-cache-size 0``: every insert is evicted at
              once (``len > max_size`` after each insert), so nothing is ever
              fetched and every reply is computed from the whole prompt. The
              reference. (``--prompt-cache-bytes 0`` would not do: mlx-lm applies
              it by ``trim_to`` only after the next request's fetch, and never on
              its sequential path.)
``vllm-mlx-none``  vllm-mlx with ``--disable-prefix-cache``, run with vllm-mlx: the
              reference of its replies. Its text is not mlx-lm's for the same
              tokens (it drops special tokens such as ``<|endoftext|>`` and decodes
              byte tokens otherwise), and it runs mlx-lm 0.31's model code, so a
              reply of vllm-mlx is judged against a cache-less vllm-mlx.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import vllm_mlx
from .servers import Server

SYSTEMS = ("mlx-lm", "vllm-mlx", "ours", "none", "vllm-mlx-none")
REFERENCE = "none"  # the cache-less mlx-lm server, which answers everyone's requests too
# the cache-less server whose replies a system's replies must equal
REFERENCE_OF = {
    "mlx-lm": REFERENCE,
    "ours": REFERENCE,
    REFERENCE: REFERENCE,
    "vllm-mlx": "vllm-mlx-none",
    "vllm-mlx-none": "vllm-mlx-none",
}


@dataclass(frozen=True, slots=True)
class Launch:
    """The settings of a run that change how the servers start."""

    block_size: int = 16  # prefixcache serve's
    mlx_lm_args: tuple[str, ...] = ()  # extra options for the plain mlx-lm server only
    vllm_mlx_cache_mb: int = vllm_mlx.CACHE_MB


def default_systems() -> tuple[str, ...]:
    """Every caching system whose software is here: vllm-mlx once ``make vllm-mlx`` built it."""
    caching = (s for s in SYSTEMS if REFERENCE_OF[s] != s)
    return tuple(s for s in caching if s != "vllm-mlx" or vllm_mlx.available())


def with_references(systems: Sequence[str]) -> tuple[str, ...]:
    """``systems``, the reference of each and ``none``, in ``SYSTEMS``' order."""
    chosen = {*systems, *(REFERENCE_OF[s] for s in systems), REFERENCE}
    return tuple(s for s in SYSTEMS if s in chosen)


def system_argv(system: str, model: Path, workdir: Path, launch: Launch) -> list[str]:
    """The command line that starts ``system`` on ``model`` (host and port added later);
    vllm-mlx's is ``vllm_mlx.argv``."""
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    if system == "mlx-lm":
        return [*plain, *launch.mlx_lm_args]
    if system == "none":
        return [*plain, "--prompt-cache-size", "0"]
    if system == "ours":
        ssd = workdir / "ssd"
        return [
            *(sys.executable, "-m", "prefixcache", "serve", "--model", str(model)),
            *("--ssd-dir", str(ssd), "--block-size", str(launch.block_size)),
        ]
    raise ValueError(f"no mlx-lm command for {system!r}; known: mlx-lm, ours, none")


def start_server(system: str, model: Path, workdir: Path, launch: Launch) -> Server:
    """Start ``system`` on ``model``, its log in ``workdir / f"{system}.log"``; not waited for."""
    if system == "vllm-mlx":
        return vllm_mlx.VllmMlxServer(system, model, workdir, launch.vllm_mlx_cache_mb)
    if system == "vllm-mlx-none":
        return vllm_mlx.VllmMlxServer(system, model, workdir, None)
    argv = system_argv(system, model, workdir, launch)
    return Server(system, argv, workdir / f"{system}.log")


def start_servers(
    model: Path, workdir: Path, systems: Sequence[str], launch: Launch
) -> dict[str, Server]:
    """Start ``systems`` on ``model`` side by side and wait until each is ready.

    Raises:
        RuntimeError: a server exited or did not answer (the others are stopped).
        ValueError: an unknown system, or vllm-mlx without its venv.
    """
    if {"vllm-mlx", "vllm-mlx-none"} & {*systems} and not vllm_mlx.available():
        raise ValueError(f"vllm-mlx: no {vllm_mlx.PYTHON}; build it with `{vllm_mlx.BUILD}`")
    shutil.rmtree(workdir / "ssd", ignore_errors=True)  # a kept --workdir: start cold
    servers: dict[str, Server] = {}
    try:
        for system in systems:
            servers[system] = start_server(system, model, workdir, launch)
        for server in servers.values():
            server.wait_ready()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers
