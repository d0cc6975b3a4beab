"""``prefixcache simulate TRACE``: a request trace through the tier policies, at full scale.

Blocks carry no payload, only byte sizes from a model shape (``--shape``:
a preset or a config.json); budgets are bytes (``--hot 64G``; a tier given no
budget is absent, ``--unlimited`` makes every given tier unbounded: the
trace's ceiling). ``--eviction optimal`` is the offline optimum of a hot-only
cache of K/V blocks; ``--eviction bound`` an upper bound on any hot-only
policy counted in bytes (a hybrid's state included: traces/bound.py);
``--eviction lru,frequency,optimal`` runs each. ``--sweep
hot=16G,64G`` runs one point per value and policy, in parallel processes,
plus the ceiling (every tier unbounded), and writes ``OUT.csv`` and
``OUT.png`` (matplotlib, the ``plot`` extra). ``--json``: one JSON object per point.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from ..config import DEFAULT_EVICTION
from ..settings import parse_bytes
from .common import EXIT_OK, Args, Command, UsageError
from .report import format_bytes, table

POLICIES = ("fifo", "lru", "cost", "density", "frequency", "adaptive", "optimal", "bound")
_OFFLINE = ("optimal", "bound")
_TIER_FLAGS = {"hot": "hot_bytes", "ssd": "ssd_bytes", "remote": "remote_bytes"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format JSONL trace")
    p.add_argument(
        "--shape", default="llama-3.1-8b", help="a preset or a config.json (or its folder)"
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8, 16, 32),
        help="K/V bits (default: the shape's: bf16, or a config.json's torch_dtype)",
    )
    p.add_argument("--hot", type=parse_bytes, help="hot tier budget (bytes: 64G)")
    p.add_argument("--ssd", type=parse_bytes, help="SSD tier budget")
    p.add_argument("--remote", type=parse_bytes, help="remote tier budget")
    p.add_argument(
        "--eviction",
        default=DEFAULT_EVICTION,
        help=f"one or more of {','.join(POLICIES)} (comma-separated; default: the library's, "
        f"{DEFAULT_EVICTION})",
    )
    p.add_argument(
        "--ssd-admit-after", type=int, default=1, help="uses before an SSD write; 0: by its reach"
    )
    p.add_argument("--ssd-write-budget", type=parse_bytes, default=0, help="bytes per day")
    p.add_argument("--unlimited", action="store_true", help="every given tier unbounded")
    p.add_argument("--sweep", help="TIER=SIZE,SIZE,...: one point per size")
    p.add_argument("--out", default="sweep", help="a sweep's OUT.csv and OUT.png")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument(
        "--device",
        help="estimate the TTFT saved on: this (measured now) or m1-max, m2-ultra, m3-max, m4-max",
    )
    p.add_argument("--json", action="store_true")


def run(args: Args) -> int:
    from ..traces.device import profile_named, ttft_saved
    from ..traces.reader import TraceError, read_trace
    from ..traces.shapes import shape_named

    try:
        device = None if args.device is None else profile_named(args.device)
        shape = shape_named(args.shape)
        shape = shape if args.kv_bits is None else shape.with_kv_bits(args.kv_bits)
    except ValueError as err:
        raise UsageError(str(err)) from None
    points = []  # every option checked before the trace is read
    for base in _configs(args, shape):
        points += _sweep(base, args.sweep) if args.sweep else [base]
    try:
        requests = read_trace(args.trace, limit=args.limit)
    except TraceError as err:
        raise UsageError(str(err)) from None
    if args.sweep:  # the trace's ceiling: every tier unbounded
        points.append(replace(points[0], eviction="lru", hot_bytes=0, ssd_bytes=None))
    with ProcessPoolExecutor(min(len(points), os.cpu_count() or 1)) as pool:
        docs = list(pool.map(_point, [(p, requests) for p in points]))
    if args.sweep:
        docs[-1]["eviction"] = "ceiling"
    if device is not None:
        docs = [d | ttft_saved(d, shape, args.block_tokens, device) for d in docs]
    for doc in docs:
        if args.json:
            print(json.dumps(doc))
    if not args.json:
        _print(docs)
    if args.sweep:
        _write(args.out, docs)
    return EXIT_OK


def _configs(args: Args, shape: object) -> list:
    """One configuration per policy of ``--eviction`` (a comma-separated list)."""
    from ..traces.simulator import SimConfig

    budgets = (args.hot, args.ssd, args.remote, args.sweep)
    if all(b is None for b in budgets) and not args.unlimited:
        raise UsageError("give a budget: --hot, --ssd, --remote, --sweep or --unlimited")
    policies = args.eviction.split(",")
    for policy in policies:
        if policy not in POLICIES:
            raise UsageError(f"--eviction: {policy!r} is not one of {', '.join(POLICIES)}")
    if args.ssd_admit_after < 0:
        raise UsageError(f"--ssd-admit-after: expected an int >= 0, got {args.ssd_admit_after}")
    offline = [p for p in policies if p in _OFFLINE]
    if offline and (args.ssd is not None or args.remote is not None):
        raise UsageError(f"--eviction {offline[0]}: a hot tier alone (one tier, offline)")
    unbounded = 0 if args.unlimited else None
    return [
        SimConfig(
            shape,  # type: ignore[arg-type]
            unbounded if args.hot is None or args.unlimited else args.hot,
            unbounded if args.ssd is not None and args.unlimited else args.ssd,
            args.remote,
            policy,
            args.ssd_admit_after,
            args.ssd_write_budget,
            args.block_tokens,
        )
        for policy in policies
    ]


def _sweep(base, text: str) -> list:
    tier, _, sizes = text.partition("=")
    if tier not in _TIER_FLAGS or not sizes:
        raise UsageError(f"--sweep: expected TIER=SIZE,... with TIER hot, ssd or remote: {text!r}")
    try:
        values = [parse_bytes(s) for s in sizes.split(",")]
    except ValueError as err:
        raise UsageError(f"--sweep: {err}") from None
    return [replace(base, **{_TIER_FLAGS[tier]: v}) for v in values]


def _point(task: tuple) -> dict[str, object]:
    from ..traces.bound import bound_hit_rates
    from ..traces.optimum import optimum_hit_rates
    from ..traces.simulator import Simulation

    config, requests = task
    doc: dict[str, object] = {
        "eviction": config.eviction,
        "hot": config.hot_bytes,
        "ssd": config.ssd_bytes,
        "remote": config.remote_bytes,
    }
    if config.eviction not in _OFFLINE:
        return doc | Simulation(config).run(requests).as_json()
    if config.eviction == "bound":
        budget = config.hot_bytes or 1 << 62
        whole, last_half = bound_hit_rates(requests, config.shape, budget, config.block_tokens)
    else:
        blocks = max(1, (config.hot_bytes or 0) // config.shape.block_bytes(config.block_tokens))
        whole, last_half = optimum_hit_rates(requests, blocks)
    prompt = sum(r.input_length for r in requests)
    return doc | {
        "requests": len(requests),
        "prompt_tokens": prompt,
        "cached_tokens": None,
        "hit_rate": whole,
        "hit_rate_last_half": last_half,
        "hit_share": {"hot": 1.0},
        "ssd_bytes_written": 0,
        "ssd_bytes_written_per_day": 0.0,
        "peak_bytes": {"hot": config.hot_bytes},
        "prefill_flops_saved": None,
        "seconds": None,
    }


def _print(docs: list[dict]) -> None:
    rows = []
    for d in docs:
        share = d["hit_share"]
        rows.append(
            [
                d["eviction"],
                *(
                    format_bytes(d[t]) if d[t] else ("-" if d[t] is None else "unbounded")
                    for t in _TIER_FLAGS
                ),
                f"{100 * d['hit_rate']:.2f}%",
                f"{100 * d['hit_rate_last_half']:.2f}%",
                " ".join(f"{t} {100 * v:.0f}%" for t, v in share.items() if v),
                format_bytes(d["ssd_bytes_written_per_day"]),
                *_ttft(d),
            ]
        )
    heads = [
        "eviction",
        "hot",
        "ssd",
        "remote",
        "hit rate",
        "last half",
        "hits from",
        "SSD writes/day",
    ]
    if "device" in docs[0]:
        heads.append(f"TTFT saved/request ({docs[0]['device']})")
    print(table(heads, rows, "lrrrrrlrr"[: len(heads)]))


def _ttft(d: dict) -> list[str]:
    if "device" not in d:
        return []
    saved = d.get("ttft_saved_per_request")
    if saved is None:
        return ["-"]
    return [f"{1000 * saved:.1f} ms" if abs(saved) < 1 else f"{saved:,.1f} s"]


def _write(out: str, docs: list[dict]) -> None:
    keys = [
        "eviction",
        "hot",
        "ssd",
        "remote",
        "hit_rate",
        "hit_rate_last_half",
        "ssd_bytes_written_per_day",
        "seconds",
    ]
    with open(f"{out}.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        for d in docs:
            writer.writerow([d[k] for k in keys])
    try:
        import matplotlib
    except ImportError:
        print(f"wrote {out}.csv (no plot: pip install 'prefixcache[plot]')", file=sys.stderr)
        return
    matplotlib.use("Agg")
    from ..traces.plot import plot_sweep

    plot_sweep(f"{out}.png", docs)


COMMANDS = [
    Command("simulate", "replay a request trace through the tier policies (sizing)", add_args, run)
]
