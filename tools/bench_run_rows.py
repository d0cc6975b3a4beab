"""A run file's window K/V read into each block's place against a loose buffer, in ONE process.

One model-shaped cache (``--shape``: presets of tools/shapes.py; gpt-oss-20b has
window layers beside full ones) of ``--tokens`` tokens is stored on the SSD tier
at each ``--blocks`` size. Its last run file's window-layer K/V are used by the
run's last blocks only: ``tiers/ssd/block_places.py`` reads them straight into
each block's place (``places``); turned off (``loose``), they are read into a
fresh buffer per tensor and then copied into the same places. Round after round
the fetch runs in each mode, in turn first, so both meet the same memory state
and load. (Where the chain's last block is not in a run file, e.g. its window
K/V kept in a file of its own, "-" stands for its read.)

Per block size and mode: the medians of the fetch's ms, of the last run file's
read (on its reader thread: ms and that thread's minor page faults) and of the
loose buffers' bytes per fetch. Where malloc reuses freed memory the loose
buffers fault nothing; ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment maps
each one fresh, as a process whose heap was given back meets them.

    [MALLOC_MMAP_THRESHOLD_=65536] python tools/bench_run_rows.py [--shape gpt-oss-20b]
        [--blocks 16,64] [--tokens 4096] [--repeat 11]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import tier_config
from shapes import filled_cache, model_for, named

from prefixcache import PrefixCache
from prefixcache.tiers.ssd import readers, run_reads
from prefixcache.tiers.ssd.block_places import BlockPlaces

MODES = ("places", "loose")
READ, LOOSE_INIT = readers.read_run_file, run_reads._Loose.__init__  # as the package has them


class Watch:
    """The run file reads and loose buffers of one fetch (their functions wrapped)."""

    def __init__(self, last: int) -> None:
        self.last = last  # the chain's last block: its run file is the one watched
        self.loose_bytes = 0
        self.read_s, self.faults = float("nan"), -1

        def read_spy(jobs, *args):
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t0 = time.perf_counter()
            out = list(READ(jobs, *args))
            if jobs[-1].meta.index == self.last:
                self.read_s = time.perf_counter() - t0
                self.faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
            yield from out

        def loose_spy(loose, tensors, *args):
            self.loose_bytes += sum(data.nbytes for data, _ in tensors.values())
            LOOSE_INIT(loose, tensors, *args)

        readers.read_run_file = read_spy
        run_reads._Loose.__init__ = loose_spy  # type: ignore[method-assign]


def fetch(pc: PrefixCache, probe: list[int], mode: str, last: int) -> tuple:
    """One fetch in ``mode``: (ms, last run file's read ms, its faults, loose bytes)."""
    take = BlockPlaces.take
    if mode == "loose":
        BlockPlaces.take = lambda *args: None  # type: ignore[method-assign]
    watch = Watch(last)
    gc.collect()
    try:
        t0 = time.perf_counter()
        cache, num = pc.fetch(probe)
        mx.eval([c.state for c in cache])
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        BlockPlaces.take = take  # type: ignore[method-assign]
        readers.read_run_file = READ
        run_reads._Loose.__init__ = LOOSE_INIT  # type: ignore[method-assign]
    assert num == len(probe) - 1, (num, len(probe))
    return ms, watch.read_s * 1e3, watch.faults, watch.loose_bytes


def measure(args, shape, block_size: int) -> dict[str, list[tuple]]:
    """Each mode's rounds at ``block_size``."""
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe, last = [*tokens, 1], args.tokens // block_size - 1
    model = model_for(shape)
    rounds: dict[str, list[tuple]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as root:
        cfg = tier_config("ssd", block_size, os.path.join(root, "ssd"))
        with PrefixCache(model, cfg, model_id="bench") as pc:
            pc.store(tokens, filled_cache(shape, model, args.tokens))
            pc.flush()
            for mode in MODES:  # warm: the page cache, the first allocations
                fetch(pc, probe, mode, last)
            for i in range(args.repeat):
                for mode in MODES if i % 2 else MODES[::-1]:
                    rounds[mode].append(fetch(pc, probe, mode, last))
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="gpt-oss-20b", help="a preset of tools/shapes.py")
    p.add_argument("--blocks", default="16", help="block sizes: 16,64")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=11)
    args = p.parse_args()
    shape = named([args.shape])[0]
    fresh = os.environ.get("MALLOC_MMAP_THRESHOLD_", "malloc's default")
    print("| shape | block | mode | fetch ms | last file ms | its faults | loose MiB |")
    print("|---|---|---|---|---|---|---|")
    for block_size in [int(b) for b in args.blocks.split(",") if b]:
        rounds = measure(args, shape, block_size)
        for mode in MODES:
            columns = zip(*rounds[mode], strict=True)
            ms, read_ms, faults, loose = (statistics.median(c) for c in columns)
            last = "- | -" if faults < 0 else f"{read_ms:.2f} | {faults:.0f}"  # -: no run file
            mib = loose / 2**20
            print(f"| {shape.name} | {block_size} | {mode} | {ms:.1f} | {last} | {mib:.2f} |")
    load = os.getloadavg()[0]
    print(f"medians of {args.repeat} rounds; mmap threshold: {fresh}; load (1 min) {load:.2f}")


if __name__ == "__main__":
    main()
