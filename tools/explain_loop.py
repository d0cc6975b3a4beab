"""An agent's tool-call loop through ``prefixcache serve``, and what its explain header says.

Builds a tiny random-weight llama whose chat template strips reasoning
(``<think>...</think>``) from every assistant message but the last, as
reasoning models' templates do, starts ``prefixcache serve`` on it, and sends
``--turns`` chat requests of an agent loop: each turn adds an assistant message
(reasoning, then a tool call) and the tool's answer. Prints one row per turn:
the prompt's tokens, the tokens the server restored, and the
``X-Prefixcache-Explain`` header's fields (where the prompt left the stored
sequence, why, the message and role it falls in, ``rerendered``). The last line
sums the prompt tokens prefilled again although a stored sequence held them
(re-rendered turns), as a share of all prompt tokens. ``--keep-reasoning`` runs
the same loop with the plain template (nothing re-rendered) for comparison.

    python tools/explain_loop.py [--turns 10] [--keep-reasoning]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefixcache.tiny.models import CHAT_TEMPLATE, STRIP_THINKING_TEMPLATE, save_model

SYSTEM = "You are a careful assistant with tools. " * 4


def agent_turns(n: int) -> list[list[dict]]:
    """Each request of the loop: the history plus one assistant turn and its tool answer."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find the weather in Paris and Rome."},
    ]
    turns = []
    for i in range(n):
        think = f"<think>I should call the tool for step {i} first.</think>"
        messages = [
            *messages,
            {"role": "assistant", "content": f'{think}<tool_call>{{"step": {i}}}</tool_call>'},
            {"role": "tool", "content": f"result {i}: sunny, {20 + i} degrees"},
        ]
        turns.append(messages)
    return turns


def with_replies(messages: list[dict], replies: list[str]) -> list[dict]:
    """``messages`` whose assistant turns after the first are the model's replies: the
    reply to a request is the next request's assistant turn."""
    out, given, first = [], iter(replies), True
    for message in messages:
        if message["role"] == "assistant" and not first:
            message = {**message, "content": next(given)}
        first = first and message["role"] != "assistant"
        out.append(message)
    return out


def post(url: str, body: dict) -> tuple[dict, dict]:
    """(reply JSON, headers) of a POST."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as reply:
        return json.loads(reply.read()), dict(reply.headers)


def fields(header: str) -> dict[str, str]:
    return dict((*part.split("=", 1), "")[:2] for part in header.split("; "))


def start_server(model: Path, ssd: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
    argv += ["--ssd-dir", str(ssd), "--block-size", "16", "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start: see {log}")


def run(turns: int, keep_reasoning: bool) -> int:
    template = CHAT_TEMPLATE if keep_reasoning else STRIP_THINKING_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = save_model(root / "llama", "llama", chat_template=template)
        proc, url = start_server(model, root / "ssd", root / "serve.log")
        try:
            rows = []
            replies: list[str] = []
            for i, messages in enumerate(agent_turns(turns)):
                if keep_reasoning:  # the model's own replies, as an agent sends them back
                    messages = with_replies(messages, replies)
                body = {"messages": messages, "temperature": 0, "max_tokens": 8}
                reply, headers = post(url + "/v1/chat/completions", body)
                replies.append(reply["choices"][0]["message"]["content"] or "")
                usage = reply["usage"]
                got = fields(headers["X-Prefixcache-Explain"])
                rows.append((i, usage["prompt_tokens"], got, rows[-1] if rows else None))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print_table(rows)
    return 0


def print_table(rows: list) -> None:
    print(
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'at':>5}  {'why':<9} {'message':>7}  "
        f"{'role':<9} rerendered"
    )
    again = total = 0
    for i, tokens, got, previous in rows:
        total += tokens
        if previous is not None and "rerendered" in got:
            again += previous[1] - int(got["at"])  # the last prompt held them: prefilled again
        print(
            f"{i:>4} {tokens:>6} {got['cached']:>6} {got['at']:>5}  {got['why']:<9} "
            f"{got.get('message', '-'):>7}  {got.get('role', '-'):<9} "
            f"{'yes' if 'rerendered' in got else 'no'}"
        )
    share = 100 * again / total if total else 0.0
    print(
        f"prompt tokens prefilled again after a re-rendered turn: {again} of {total} ({share:.1f}%)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10, help="tool-call turns (default: 10)")
    parser.add_argument(
        "--keep-reasoning", action="store_true", help="the plain template (nothing stripped)"
    )
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run(args.turns, args.keep_reasoning)


if __name__ == "__main__":
    sys.exit(main())
