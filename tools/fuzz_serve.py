"""Fuzz ``prefixcache serve`` for longer than the test suite does.

Starts ``prefixcache serve`` on a tiny llama built offline (SSD tier, small
generation limits, a short client timeout), caches a known conversation, then
sends ``--cases`` property-based requests (``fuzzlib.cases``), each followed
by ``GET /health``; every one must be answered 200, 400 or 413. Then the
connection-level cases (a slow body, a stalled one, a cut one, ``--idle``
connections left open) and, last, the known conversation again: it must reply
the same from its cache. A failing case is shrunk by hypothesis and printed.

    python tools/fuzz_serve.py --cases 5000
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import fuzzlib
from hypothesis import HealthCheck, given, seed, settings
from reuselib.servers import Server

from prefixcache.tiny.models import save_model

SYSTEM = "You are a careful assistant for a mountain railway. Answer briefly. " * 6
CLIENT_TIMEOUT = 2.0


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="fuzzed requests")
    p.add_argument("--idle", type=int, default=200, help="idle connections held open")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    return p


def conversation(url: str) -> tuple[str, int]:
    """(reply, cached tokens) of one greedy chat on SYSTEM."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Sundays?"}]
    body = {"messages": messages, "temperature": 0, "max_tokens": fuzzlib.MAX_TOKENS}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as reply:
        doc = json.load(reply)
    cached = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
    return doc["choices"][0]["message"]["content"], cached


def fuzz(url: str, cases: int, fuzz_seed: int) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @seed(fuzz_seed)
    @given(fuzzlib.cases())
    def one(case):
        statuses[fuzzlib.check(url, case)] += 1

    one()
    return statuses


def connections(url: str, idle: int) -> dict[str, object]:
    slow = fuzzlib.slow_body(url)
    stalled, seconds = fuzzlib.stalled_body(url, timeout=30)
    cut = fuzzlib.cut_body(url)
    with fuzzlib.idle_connections(url, idle) as socks:
        busy = fuzzlib.health(url)
        closed = sum(fuzzlib.closed_by_server(s, CLIENT_TIMEOUT * 10) for s in socks)
    return {
        "slow body": slow,
        "stalled body": f"{stalled} after {seconds:.1f}s",
        "cut body": cut,
        f"health with {idle} idle connections": busy,
        "idle connections closed by the server": f"{closed}/{idle}",
        "health after": fuzzlib.health(url),
    }


def main() -> int:
    args = setup_arg_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="fuzz-serve-") as tmp:
        model = save_model(Path(tmp) / "llama", "llama")
        argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
        argv += ["--ssd-dir", f"{tmp}/ssd", "--block-size", "16", "--max-tokens", "2"]
        argv += ["--max-tokens-limit", str(fuzzlib.MAX_TOKENS)]
        argv += ["--client-timeout", str(CLIENT_TIMEOUT)]
        server = Server("ours", argv, Path(tmp) / "serve.log")
        try:
            server.wait_ready()
            conversation(server.url)
            before = conversation(server.url)
            start = time.monotonic()
            statuses = fuzz(server.url, args.cases, args.seed)
            minutes = (time.monotonic() - start) / 60
            results = connections(server.url, args.idle)
            after = conversation(server.url)
        finally:
            server.stop()
    print(f"{sum(statuses.values())} cases in {minutes:.1f} min: {dict(sorted(statuses.items()))}")
    for name, value in results.items():
        print(f"{name}: {value}")
    print(f"known conversation: before {before!r}, after {after!r}: same={before == after}")
    return 0 if before == after and before[1] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
