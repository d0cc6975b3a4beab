"""SSD restore of one chain stored in two tensor orders, fetched alternately in one process.

The chain of ``--shape`` (a preset of tools/shapes.py) is stored twice, at each
``--blocks`` size, into two SSD tiers: once as the writer lays payload files
out (``tail``: the layers whose payloads only some blocks keep, window K/V and
recurrent state, after the others) and once with every layer in layer order
(``layer``: as files were written before). Each round fetches both and reads
one file of the restored bytes into one fresh buffer (the reference of
tools/bench_blocks.py), in alternating order, so both orders see the same load.
Printed per block size: the medians of fetch / reference (wall, and CPU time
of this process) for each order, and of the two fetches' ratio.

    python tools/bench_layout.py --shape gpt-oss-20b [--blocks 16,32,64,256] [--repeat 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import read_into_fresh, tier_config
from shapes import cache_bytes, filled_cache, model_for, named

from prefixcache import PrefixCache
from prefixcache.cache import capture

TOKENS = 4096
ORDERS = ("tail", "layer")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="gpt-oss-20b", help="a preset of tools/shapes.py")
    p.add_argument("--blocks", default="16,32,64,256", help="block sizes, comma-separated")
    p.add_argument("--repeat", type=int, default=9, help="rounds per block size")
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    return p


def timed(work) -> tuple[float, float]:
    """(wall, CPU time of this process) of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def stored(model, tokens, cache, block_size: int, root: str, order: str) -> PrefixCache:
    """A cache whose SSD tier holds ``cache`` (of ``tokens``), its files in ``order``."""
    kept = capture.partial_layers
    if order == "layer":  # as the writer laid files out before: every layer in layer order
        capture.partial_layers = lambda reaches, length: frozenset()
    try:
        pc = PrefixCache(
            model, tier_config("ssd", block_size, os.path.join(root, order)), model_id="bench"
        )
        pc.store(tokens, cache)
        pc.flush()
    finally:
        capture.partial_layers = kept
    return pc


def measure(shape, model, block_size: int, rounds: int, root: str) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 512, TOKENS).tolist()
    probe = [*tokens, 1]
    cache = filled_cache(shape, model, TOKENS)
    nbytes = cache_bytes(cache, TOKENS, block_size)
    pcs = {order: stored(model, tokens, cache, block_size, root, order) for order in ORDERS}
    del cache
    path = os.path.join(root, "one.file")
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))

    def fetch(pc: PrefixCache) -> None:
        cache, num = pc.fetch(probe)
        mx.eval([c.state for c in cache])
        assert num == TOKENS, num

    jobs = {"ref": lambda: read_into_fresh(path, nbytes)}
    jobs.update({order: (lambda pc=pc: fetch(pc)) for order, pc in pcs.items()})
    for pc in pcs.values():
        fetch(pc)  # warm: the page cache, MLX's first allocations
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in jobs}
    for r in range(rounds):
        for k in list(jobs) if r % 2 else list(reversed(jobs)):
            got[k].append(timed(jobs[k]))
    for pc in pcs.values():
        pc.close()
    os.remove(path)
    out = {"block": block_size, "ref_ms": statistics.median(w for w, _ in got["ref"]) * 1e3}
    for k in ORDERS:
        out[f"{k}_ms"] = statistics.median(w for w, _ in got[k]) * 1e3
        out[f"{k}_ratio"] = statistics.median(
            t[0] / r[0] for t, r in zip(got[k], got["ref"], strict=True)
        )
        out[f"{k}_cpu"] = statistics.median(
            t[1] / r[1] for t, r in zip(got[k], got["ref"], strict=True)
        )
    pairs = zip(got["tail"], got["layer"], strict=True)
    out["tail/layer"] = statistics.median(t[0] / s[0] for t, s in pairs)
    return out


def main() -> None:
    args = setup_arg_parser().parse_args()
    (shape,) = named([args.shape])
    model = model_for(shape)
    print(f"load average (1 min) at start {os.getloadavg()[0]:.2f}")
    print(
        "| block | ref ms | tail ms | layer ms | tail / ref | layer / ref | tail cpu / ref cpu "
        "| layer cpu / ref cpu | tail / layer |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for block_size in (int(b) for b in args.blocks.split(",") if b):
            r = measure(shape, model, block_size, args.repeat, root)
            print(
                f"| {r['block']} | {r['ref_ms']:.1f} | {r['tail_ms']:.1f} | {r['layer_ms']:.1f} "
                f"| {r['tail_ratio']:.2f} | {r['layer_ratio']:.2f} | {r['tail_cpu']:.2f} "
                f"| {r['layer_cpu']:.2f} | {r['tail/layer']:.2f} |",
                flush=True,
            )
    print(f"load average (1 min) at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
