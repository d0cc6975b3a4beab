"""The remote benchmark's single-server parts: what ``store`` costs on the caller's
thread with the remote tier, and what an unreachable server adds to a fetch
(tools/bench_remote.py runs them)."""

from __future__ import annotations

import os
import signal
import statistics
import time

from benchlib import synthetic_cache

from prefixcache import PrefixCache


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def store_cost(args, model, server, config) -> dict[str, float]:
    """ms: ``store`` of a chain on the caller's thread without and with the remote
    tier (blocks go remote on store), and how long until the server has them all."""
    out: dict[str, list[float]] = {
        "store, no remote tier": [],
        "store, remote tier": [],
        "until every block is on the server": [],
    }
    for r in range(args.repeat):
        tokens = list(range(10_000 * (r + 1), 10_000 * (r + 1) + args.tokens))
        cache = synthetic_cache(args, len(tokens))
        with PrefixCache(model, config(args, None), model_id="bench") as pc:
            out["store, no remote tier"].append(timed(pc.store, tokens, cache))
        with PrefixCache(model, config(args, server.url), model_id="bench") as pc:
            out["store, remote tier"].append(timed(pc.store, tokens, cache))
            out["until every block is on the server"].append(timed(pc.flush))
        server.client().flushall()
    return {k: statistics.median(v) * 1000 for k, v in out.items()}


def unreachable(args, model, server, config) -> dict[str, float]:
    """Fetch latency (ms) of a local miss: no remote, hung server, refused connection."""
    prompt = list(range(3, 3 + 2 * args.block_size + 1))
    out = {}
    with PrefixCache(model, config(args, None), model_id="bench") as pc:
        out["no remote tier"] = statistics.median(timed(pc.fetch, prompt) for _ in range(5))
    for case in ("hung", "refused"):
        if case == "hung":
            os.kill(server.proc.pid, signal.SIGSTOP)
        else:
            os.kill(server.proc.pid, signal.SIGCONT)
            server.kill()
        fast = config(args, server.url, remote_timeout_ms=args.timeout_ms)
        with PrefixCache(model, fast, model_id="bench") as pc:
            out[f"{case}: first request"] = timed(pc.fetch, prompt)
            out[f"{case}: breaker open"] = statistics.median(
                timed(pc.fetch, prompt) for _ in range(5)
            )
            assert pc.stats()["remote"]["breaker_open"] == 1
    return {k: v * 1000 for k, v in out.items()}
