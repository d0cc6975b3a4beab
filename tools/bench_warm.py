"""Warm start after a restart: time to the first hit, and requests served during the warm-up.

An SSD tier of ``--ssd-gib`` (default 1 GiB) is filled through a real
PrefixCache with ``--chains`` chains of a model-shaped synthetic cache
(benchlib's: default 28 layers, 4 kv heads, head_dim 128, bf16: Qwen2.5-7B's
shape, 56 KiB per token), oldest first. Then, in ONE run, the cache is opened
again ("the restart": the page cache of the tier's files dropped first),
alternately

  warm   ``warm_bytes`` = half of ``--hot-gib`` (what ``prefixcache serve``
         does): pinned, then the most recently used chains load into hot in
         the background
  cold   the reference: the same open and requests without warm start

``--repeat`` times each, with the same requests, in two phases:

  first  right after the open, back to back from one thread: ``--requests``
         whole chains among the oldest (the warm-up does not load them), served
         while the warm-up runs; a request that waited for the warm-up would
         take about as long as the warm-up itself
  later  once the warm-up is done (cold: as long after the open): the
         ``--requests`` most recently used chains (those the warm-up loads)

Per run: open time, time from the open to the first hit (a fetch that restored
tokens), every request's latency, and per request its latency with warm start
against the same request without it in the same round (medians, range over
the rounds). From round 2 on, the requests of earlier rounds count as recent
use (as after any restart): the warm-up skips what the first phase put in hot.

    python tools/bench_warm.py [--ssd-gib 1 --chains 18 --requests 4 --repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from benchlib import drop_caches, shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache

GIB = 1 << 30


def fill(model, args, cfg: CacheConfig) -> list[list[int]]:
    """Store ``--chains`` chains filling ``--ssd-gib``; returns their tokens, oldest first."""
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 2
    tokens_each = int(args.ssd_gib * GIB / per_token / args.chains) // args.block_size
    tokens_each *= args.block_size
    rng = np.random.default_rng(0)
    chains = [rng.integers(0, 32000, tokens_each).tolist() for _ in range(args.chains)]
    store_cfg = cfg.replace(hot_max_bytes=per_token * tokens_each, write_policy="write_through")
    with PrefixCache(model, store_cfg, model_id="bench-warm") as pc:
        for tokens in chains:
            pc.store(tokens, synthetic_cache(args, len(tokens)))
            pc.flush()
        nbytes = pc.stats()["ssd"]["written_bytes"]
    print(f"SSD tier: {len(chains)} chains x {tokens_each} tokens = {nbytes / GIB:.2f} GiB")
    return chains


def restart(
    model, cfg: CacheConfig, during: list[list[int]], after: list[list[int]], pause: float | None
) -> dict:
    """Open the cache, serve ``during`` at once, then ``after`` once the warm-up is done
    (without one: ``pause`` seconds after the open); timings and warm-up stats."""
    drop_caches([str(p) for p in Path(cfg.ssd_path).rglob("*") if p.is_file()], level=1)
    gc.collect()
    began = time.perf_counter()
    pc = PrefixCache(model, cfg, model_id="bench-warm")
    out: dict = {"open": time.perf_counter() - began, "first_hit": None}
    warm = pc.services.warm
    try:
        out["during"] = [_request(pc, tokens, began, out) for tokens in during]
        out["overlapped"] = warm is not None and not warm.done.is_set()
        if warm is not None:
            warm.done.wait(600)
        else:
            time.sleep(max(0.0, (pause or 0.0) - (time.perf_counter() - began)))
        out["after"] = [_request(pc, tokens, began, out) for tokens in after]
        st = pc.stats().get("warm", {})
    finally:
        pc.close()
    out["warm_seconds"] = warm.seconds if warm is not None else None
    out["warm_bytes"] = st.get("nbytes", 0)
    return out


def _request(pc: PrefixCache, tokens: list[int], began: float, out: dict) -> tuple[float, int]:
    """One fetch: (seconds, hot block hits); notes the time of the first hit in ``out``."""
    before = pc.stats()["hot_block_hits"]
    t = time.perf_counter()
    cache, num = pc.fetch(tokens)
    mx.eval([c.state for c in cache])
    seconds = time.perf_counter() - t
    if out["first_hit"] is None and num > 0:
        out["first_hit"] = time.perf_counter() - began
    return seconds, pc.stats()["hot_block_hits"] - before


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ssd-gib", type=float, default=1.0)
    p.add_argument("--hot-gib", type=float, default=1.0, help="warm_bytes is half of it")
    p.add_argument("--chains", type=int, default=18)
    p.add_argument("--requests", type=int, default=4, help="in each phase")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="parent directory (default: system temp)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model = shaped_model(args)
    with tempfile.TemporaryDirectory(prefix="bench-warm-", dir=args.dir) as tmp:
        cfg = CacheConfig(
            block_size=args.block_size,
            ssd_dir=tmp,
            ssd_max_bytes=int(2 * args.ssd_gib * GIB),
            ssd_min_free_bytes=0,
            hot_max_bytes=int(args.hot_gib * GIB),
            counters_save_seconds=0,
        )
        chains = fill(model, args, cfg)
        during = [[*c, 1] for c in chains[: args.requests]]  # the oldest: left on SSD
        after = [[*c, 1] for c in chains[::-1][: args.requests]]  # the most recent
        warm_cfg = cfg.replace(warm_bytes=int(args.hot_gib * GIB) // 2)
        rounds = []
        for r in range(args.repeat):
            warm = restart(model, warm_cfg, during, after, None)
            cold = restart(model, cfg, during, after, warm["warm_seconds"])
            rounds.append((cold, warm))
            print(_line(f"round {r + 1} cold", cold))
            print(_line(f"round {r + 1} warm", warm))
    print()
    print(_table(rounds))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f} ms"


def _line(name: str, run: dict) -> str:
    during, after = [s for s, _ in run["during"]], [s for s, _ in run["after"]]
    warm = ""
    if run["warm_seconds"] is not None:
        overlap = "all of them" if run["overlapped"] else "not all"
        warm = (
            f"; warm-up {run['warm_bytes'] / 2**20:.0f} MiB in {run['warm_seconds']:.2f} s "
            f"(the first requests were served meanwhile: {overlap})"
        )
    return (
        f"{name}: open {_ms(run['open'])}, first hit at {_ms(run['first_hit'])}; first "
        f"requests median {_ms(statistics.median(during))}, slowest {_ms(max(during))}; later "
        f"requests median {_ms(statistics.median(after))}, hot block hits "
        f"{sum(h for _, h in run['after'])}{warm}"
    )


def _table(rounds: list[tuple[dict, dict]]) -> str:
    def med(values: list[float]) -> str:
        low, mid, high = (1000 * f(values) for f in (min, statistics.median, max))
        return f"{mid:.0f} ms ({low:.0f}-{high:.0f})"

    def ratio(phase: str) -> str:
        pairs = [zip(cold[phase], warm[phase], strict=True) for cold, warm in rounds]
        each = [w[0] / c[0] for run in pairs for c, w in run]
        low, mid, high = min(each), statistics.median(each), max(each)
        return f"{mid:.2f} ({low:.2f}-{high:.2f})"

    colds, warms = [c for c, _ in rounds], [w for _, w in rounds]
    loaded = "/".join(str(r["warm_bytes"] >> 20) for r in warms)  # per round

    def row(name: str, get) -> str:
        return f"| {name} | {med([get(r) for r in colds])} | {med([get(r) for r in warms])} |"

    return "\n".join(
        [
            "| | cold (no warm start) | warm start | warm / cold, same request |",
            "|---|---:|---:|---:|",
            row("open", lambda r: r["open"]) + " |",
            row("time to first hit", lambda r: r["first_hit"]) + " |",
            row("first requests (during the warm-up), median", _median("during"))
            + f" {ratio('during')} |",
            row("first requests, slowest", _slowest("during")) + " |",
            row("later requests (after it), median", _median("after")) + f" {ratio('after')} |",
            f"| warm-up | | {loaded} MiB in {med([r['warm_seconds'] for r in warms])} | |",
        ]
    )


def _median(phase: str):
    return lambda run: statistics.median(s for s, _ in run[phase])


def _slowest(phase: str):
    return lambda run: max(s for s, _ in run[phase])


if __name__ == "__main__":
    main()
