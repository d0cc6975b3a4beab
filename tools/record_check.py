"""``prefixcache serve --record-trace`` under the demo's chats, replayed by ``simulate``.

Serves the tiny llama (``--block-size 16``) with ``--record-trace``, sends the
demo's chats (a shared system prompt, conversations interleaved turn by turn,
greedy replies), then runs ``prefixcache simulate`` on the recorded file with
the model's own bytes per block (``--shape MODEL --kv-bits 32``) and prints the
hit rate the server counted (its ``usage``) next to the simulated one.

    python tools/record_check.py [--conversations 3] [--turns 3] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from reuselib.servers import Server

from prefixcache.cli.demo import _texts
from prefixcache.tiny.models import save_model

BLOCK = 16


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--turn-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--keep", help="copy the recorded trace to this file")
    return p


def serve_chats(server: Server, args: argparse.Namespace) -> tuple[int, int]:
    """The demo's chats through ``server``: (prompt tokens, cached tokens) it reported."""
    system, *users = _texts(1 + args.conversations * args.turns, args.system_words)
    users = [" ".join(u.split()[: args.turn_words]) for u in users]
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    prompt = cached = 0
    for _ in range(args.turns):
        for history in histories:
            history.append({"role": "user", "content": users.pop()})
            reply = server.chat(history, args.max_tokens)
            if reply.error:
                raise RuntimeError(f"request failed: {reply.error}")
            prompt += reply.prompt_tokens
            cached += reply.cached_tokens
            history.append({"role": "assistant", "content": reply.text})
    return prompt, cached


def main() -> None:
    args = setup_arg_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="record-check-") as tmp:
        work = Path(tmp)
        model = save_model(work / "llama", "llama")
        trace = work / "served.jsonl"
        argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
        argv += ["--ssd-dir", str(work / "ssd"), "--block-size", str(BLOCK)]
        server = Server("prefixcache", [*argv, "--record-trace", str(trace)], work / "serve.log")
        try:
            server.wait_ready()
            prompt, cached = serve_chats(server, args)
        finally:
            server.stop()
        sim = [sys.executable, "-m", "prefixcache", "simulate", str(trace), "--shape", str(model)]
        sim += ["--kv-bits", "32", "--block-tokens", str(BLOCK), "--hot", "1G", "--json"]
        doc = json.loads(subprocess.run(sim, capture_output=True, check=True, text=True).stdout)
        if args.keep:
            Path(args.keep).write_text(trace.read_text())
    lines = doc["requests"]
    print(f"requests {lines}, prompt tokens {prompt}")
    print(f"server counted: {100 * cached / prompt:.2f}% of prompt tokens cached")
    print(f"simulate on the recorded trace: {100 * doc['hit_rate']:.2f}%")
    print(f"difference: {100 * (doc['hit_rate'] - cached / prompt):+.2f} points")


if __name__ == "__main__":
    main()
