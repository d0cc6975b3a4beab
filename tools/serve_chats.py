"""Image chats and speculative decoding through ``prefixcache serve`` against ``mlx_lm.server``.

Two chats, each sent turn by turn (greedy) to three real server processes on
the same model: ``mlx_lm.server`` (mlx-lm: its own prompt cache), the same
with ``--prompt-cache-size 0`` (none: reuses nothing, the reference replies)
and ``prefixcache serve`` (ours: hot + SSD tiers).

- ``vision``: a tiny muse_spark (mlx-lm 0.32.2's one model with an image
  processor, ``prefixcache/tiny/vision.py``; its Metal kernels replaced by
  MLX ops on a CPU, ``prefixcache/tiny/muse_cpu.py``), a 4-turn chat with an
  image in the first and the third user message (PNG data URLs drawn in
  the tool), then two probes: the first turn with another image, and the
  third turn with another image (everything before it the same).
- ``draft``: a tiny llama served with a tiny llama draft model
  (``--draft-model``, same tokenizer), a 4-turn chat and a second chat on
  the same system prompt.

Prints one row per request: the prompt tokens, each server's cached tokens,
and whether its reply equals the reference's. Timings are not compared.

    python tools/serve_chats.py                  # both chats
    python tools/serve_chats.py --chats vision --max-tokens 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reuselib.servers import Reply, Server

from prefixcache.tiny.models import save_model
from prefixcache.tiny.vision import image_url, save_vision_model

SERVERS = ("mlx-lm", "none", "ours")
BLOCK_SIZE = 16
SYSTEM = "You describe pictures for a museum audio guide. Be short and precise. " * 3
Messages = list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a chat: a new turn (``probe_of`` None: the chat goes on with its
    reply), or a probe that replaces turn ``probe_of`` (0-based) and ends there."""

    name: str
    user: dict[str, Any]
    probe_of: int | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """A request sent and its reply."""

    messages: Messages
    reply: Reply


def _user(text: str, image: int | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    parts = [{"type": "image_url", "image_url": {"url": image_url(image)}}]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def vision_turns() -> list[Turn]:
    """Images 1 and 2 in turns 1 and 3; the probes swap in images 3 and 4."""
    return [
        Turn("turn 1 (image 1)", _user("What is in this picture?", 1)),
        Turn("turn 2", _user("Describe its colours.")),
        Turn("turn 3 (image 2)", _user("And in this one?", 2)),
        Turn("turn 4", _user("Which of the two is brighter?")),
        Turn("turn 1 with image 3", _user("What is in this picture?", 3), probe_of=0),
        Turn("turn 3 with image 4", _user("And in this one?", 4), probe_of=2),
    ]


def draft_turns() -> list[Turn]:
    """A 4-turn chat, then a second chat's first turn on the same system prompt."""
    asked = ("Which room holds the maps?", "How old are they?", "Who drew them?", "Thanks!")
    turns = [Turn(f"turn {i + 1}", _user(q)) for i, q in enumerate(asked)]
    return [*turns, Turn("chat 2, turn 1", _user("Where is the cafe?"), probe_of=0)]


def run_chat(server: Server, turns: Sequence[Turn], max_tokens: int) -> list[Sent]:
    """Send ``turns`` in order: each request's messages and reply."""
    history: Messages = [{"role": "system", "content": SYSTEM}]
    before: list[Messages] = []  # the messages before each new turn
    sent = []
    for turn in turns:
        messages = [*(history if turn.probe_of is None else before[turn.probe_of]), turn.user]
        reply = server.chat(messages, max_tokens)
        if reply.error:
            raise RuntimeError(f"{server.name}: {turn.name}: {reply.error}: {server.tail()}")
        sent.append(Sent(messages, reply))
        if turn.probe_of is None:
            before.append(history)
            history = [*messages, {"role": "assistant", "content": reply.text}]
    return sent


CHATS = {"vision": vision_turns, "vision-window": vision_turns, "draft": draft_turns}
WINDOW = 64  # vision-window: the first layer's sliding window


def server_argv(name: str, chat: str, model: Path, draft: Path | None, ssd: Path) -> list[str]:
    """How each server starts (the vision model's kernels: prefixcache.tiny.muse_cpu)."""
    py = sys.executable
    if chat.startswith("vision"):
        head = [py, "-m", "prefixcache.tiny.muse_cpu", "ours" if name == "ours" else "plain"]
    else:
        head = [py, "-m", "prefixcache", "serve"] if name == "ours" else [py, "-m", "mlx_lm.server"]
    argv = [*head, "--model", str(model)]
    if draft is not None:
        argv += ["--draft-model", str(draft)]
    if name == "none":
        argv += ["--prompt-cache-size", "0"]
    if name == "ours":
        argv += ["--ssd-dir", str(ssd), "--block-size", str(BLOCK_SIZE)]
    return argv


def make_models(chat: str, workdir: Path) -> tuple[Path, Path | None]:
    """The chat's model (and draft model) directories, built offline."""
    if chat.startswith("vision"):
        window = WINDOW if chat == "vision-window" else None
        return save_vision_model(workdir / chat, sliding_window=window), None
    return save_model(workdir / chat, "llama"), save_model(workdir / "draft-model", "llama", seed=1)


@contextmanager
def started(name: str, argv: list[str], log: Path) -> Iterator[Server]:
    server = Server(name, argv, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def compare(
    chat: str, workdir: Path, max_tokens: int, servers: Sequence[str] = SERVERS
) -> dict[str, list[Sent]]:
    """Each server's requests and replies on ``chat``, one server at a time (they
    would share the machine's cores); the model is built under ``workdir / chat``."""
    model, draft = make_models(chat, workdir)
    turns = CHATS[chat]()
    results = {}
    for name in servers:
        argv = server_argv(name, chat, model, draft, workdir / f"ssd-{chat}")
        with started(name, argv, workdir / f"{chat}-{name}.log") as server:
            results[name] = run_chat(server, turns, max_tokens)
    return results


def table(chat: str, results: dict[str, list[Sent]]) -> str:
    """One row per request: prompt tokens, cached tokens per server, replies equal to none's."""
    head = f"{'request':<22} {'prompt':>6} {'mlx-lm':>7} {'ours':>5}  same reply (mlx-lm, ours)"
    lines = [f"{chat}:", head]
    for i, turn in enumerate(CHATS[chat]()):
        ref, plain, ours = (results[name][i].reply for name in ("none", "mlx-lm", "ours"))
        same = ", ".join("yes" if r.text == ref.text else "NO" for r in (plain, ours))
        row = f"{turn.name:<22} {ref.prompt_tokens:>6} {plain.cached_tokens:>7}"
        lines.append(f"{row} {ours.cached_tokens:>5}  {same}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", nargs="+", choices=tuple(CHATS), default=list(CHATS))
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--replies", action="store_true", help="print the reference replies")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve-chats-") as tmp:
        for chat in args.chats:
            results = compare(chat, Path(tmp), args.max_tokens)
            print(table(chat, results), flush=True)
            for turn, sent in zip(CHATS[chat](), results["none"], strict=True):
                if args.replies:
                    print(f"  {turn.name}: {sent.reply.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
