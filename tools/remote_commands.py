"""What each request costs the remote tier's server as the server fills.

The sustained table's remote configuration (the README's loop on the tiny
llama, block 16, a 2 MiB hot budget, a 16 MiB SSD cap and a remote tier on a
redis-server this tool starts and stops), requests back to back. Every
``--every`` requests one line: the rate, the milliseconds per request spent
in fetch, prefill of the rest and store, the process's RSS, the server's
memory and key count, and the Redis commands per request over the window
(``INFO commandstats``). A lookup whose cost grows with what the server holds
shows as commands per request that grow from line to line.

    python tools/remote_commands.py --requests 3000 --every 250
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from soaklib import common
from soaklib.common import prefill
from soaklib.sustained import Prompts, rss

from prefixcache import PrefixCache
from prefixcache.tiny.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer  # the tests' server launcher

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--every", type=int, default=250, help="requests per line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the temp directories go")
    return p


def calls(client) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


def line(k: int, seconds: float, phases: list[float], num: int, client, used: dict) -> str:
    now = calls(client)
    per = {c: (n - used.get(c, 0)) / num for c, n in now.items() if n - used.get(c, 0)}
    used.clear()
    used.update(now)
    ms = " / ".join(f"{1000 * p / num:.1f}" for p in phases)
    cmds = ", ".join(f"{c} {n:.1f}" for c, n in sorted(per.items()) if n >= 0.05)
    return (
        f"{k:>7} {num / seconds:6.1f} req/s  fetch / prefill / store {ms} ms  RSS "
        f"{rss() / MiB:.1f} MiB  redis {client.info('memory')['used_memory'] / MiB:.1f} MiB, "
        f"{client.dbsize()} keys  per request: {cmds}"
    )


def run(args, server: RedisServer, tmp: str) -> None:
    model = build_model("llama")
    cfg = common.config(tmp, hot_max_bytes=2 * MiB, ssd_max_bytes=16 * MiB)
    cfg = cfg.replace(restore_headroom=256, ssd_min_free_bytes=1 << 30, remote_url=server.url)
    client, prompts, used = server.client(), Prompts(args.seed), {}
    used.update(calls(client))
    phases, start = [0.0, 0.0, 0.0], time.perf_counter()
    with PrefixCache(model, cfg, model_id=common.MODEL_ID) as pc:
        for k in range(1, args.requests + 1):
            tokens = prompts.next()
            a = time.perf_counter()
            cache, n = pc.fetch(tokens)
            b = time.perf_counter()
            prefill(model, tokens[n:], cache)
            c = time.perf_counter()
            pc.store(tokens, cache)
            for i, t in enumerate((b - a, c - b, time.perf_counter() - c)):
                phases[i] += t
            if k % args.every == 0:
                seconds = time.perf_counter() - start
                print(line(k, seconds, phases, args.every, client, used), flush=True)
                phases, start = [0.0, 0.0, 0.0], time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.requests < 1 or args.every < 1:
        print(f"--requests and --every must be >= 1, got {args.requests}, {args.every}")
        return 2
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="remote-commands-redis-") as work,
        tempfile.TemporaryDirectory(dir=args.dir, prefix="remote-commands-") as tmp,
    ):
        server = RedisServer(work)
        try:
            run(args, server, tmp)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
