"""What a busy Python thread in the same process costs a fetch.

A restore hands its copies and reads to numpy and the kernel, releasing the GIL
around each one; every time it takes the GIL back it waits for the thread
holding it. A thread running pure Python holds it until the interpreter's
switch interval (5 ms by default) runs out, so each of a restore's thousands
of GIL hand-offs can wait that long. This times the same fetch of a 4,096-token
chain (128 MiB, bench_blocks' shape) from the hot and the SSD tier (page cache
warm), at ``--block-sizes``, alone and beside one thread spinning in Python,
at the default switch interval and at ``--interval``. Medians of ``--repeat``
fetches each; the reference (the fetch alone) is timed in the same run.

    python tools/bench_gil.py [--block-sizes 16 256] [--interval 0.0002]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np
from benchlib import add_chain_args, shaped_model, synthetic_cache, tier_config

from prefixcache import PrefixCache


def spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def timed_fetches(pc: PrefixCache, probe: list[int], repeat: int, busy: bool) -> float:
    stop = threading.Event()
    other = threading.Thread(target=spin, args=(stop,), daemon=True) if busy else None
    if other is not None:
        other.start()
    try:
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            cache, _ = pc.fetch(probe)
            mx.eval([c.state for c in cache])
            times.append(time.perf_counter() - began)
            del cache
    finally:
        stop.set()
        if other is not None:
            other.join()
    return statistics.median(times) * 1e3


def measure(model, args, tier: str, block_size: int, tokens: list[int], default: float):
    """Alone and busy, at the default switch interval and at ``args.interval``."""
    probe = [*tokens, 1]
    row = []
    with (
        tempfile.TemporaryDirectory() as root,
        PrefixCache(model, tier_config(tier, block_size, root), model_id="bench") as pc,
    ):
        cache = synthetic_cache(args, args.tokens)
        pc.store(tokens, cache)
        pc.flush()
        del cache
        timed_fetches(pc, probe, 1, False)  # warm: page cache, allocator
        for interval in (default, args.interval):
            sys.setswitchinterval(interval)
            try:
                row += [timed_fetches(pc, probe, args.repeat, busy) for busy in (False, True)]
            finally:
                sys.setswitchinterval(default)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 256], 3)
    p.add_argument("--interval", type=float, default=0.0002, help="seconds, the other setting")
    args = p.parse_args()
    model = shaped_model(args)
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    default = sys.getswitchinterval()
    print(f"switch interval: default {default * 1e3:g} ms, other {args.interval * 1e3:g} ms")
    print("| tier | block | alone | beside a busy thread | alone, other interval | busy, other |")
    print("|---|---|---|---|---|---|")
    for tier in ("hot", "ssd"):
        for block_size in args.block_sizes:
            row = measure(model, args, tier, block_size, tokens, default)
            cells = " | ".join(f"{ms:.1f} ms" for ms in row)
            print(f"| {tier} | {block_size} | {cells} |")


if __name__ == "__main__":
    main()
