"""Hot restores with and without runs (``hot_run_tokens``), in one process.

One model-shaped cache (``--shape``: a preset of tools/shapes.py) of ``--tokens``
tokens is stored once per (block size, run tokens) pair in its own hot-only
``PrefixCache``; then, round after round, each is restored through
``PrefixCache.fetch`` and followed by the reference: the same bytes copied into
ONE fresh numpy buffer (``empty`` + ``copyto``; the bytes a restore copies, as
tools/bench_blocks.py counts them, at the smallest block size). Every restore and reference of
a round runs in the same memory state (the same process, buffers freed between
them), which ``tools/bench_blocks.py``'s separate processes per checkout and its
block sizes in order do not give. Prints the medians: fetch ms, fetch / the
reference's median, and whether it meets the hot target (1.2x + 1 ms).

    python tools/bench_runs.py [--shape llama-3.2-1b] [--blocks 16,32,256]
        [--run-tokens 0,256,1024] [--tokens 4096] [--repeat 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np
from shapes import cache_bytes, filled_cache, model_for, named

from prefixcache import CacheConfig, PrefixCache


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", help="a preset of tools/shapes.py")
    p.add_argument("--blocks", type=_ints, default=[16, 32, 256], help="block sizes: 16,32")
    p.add_argument("--run-tokens", type=_ints, default=[0, 256, 1024], help="0: per block")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=7)
    return p


def timed(fn) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread) of ``fn()``."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def copy_into_fresh(source: np.ndarray) -> None:
    out = np.empty_like(source)
    np.copyto(out, source)


def main() -> None:
    args = setup_arg_parser().parse_args()
    try:
        shape = named([args.shape])[0]
    except ValueError as err:
        raise SystemExit(str(err)) from None
    model = model_for(shape)
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    caches: dict[tuple[int, int], PrefixCache] = {}
    for bs in args.blocks:
        for run in args.run_tokens:
            cfg = CacheConfig(
                block_size=bs, hot_cache_only=True, hot_max_bytes=64 << 30, hot_run_tokens=run
            )
            pc = caches[bs, run] = PrefixCache(model, cfg, model_id="bench")
            filled = filled_cache(shape, model, args.tokens)
            pc.store(tokens, filled)
    # the bytes a restore copies (a window layer's last blocks only; not every block's
    # window payload and state snapshot the tier holds), at the smallest block size
    nbytes = cache_bytes(filled, args.tokens, min(args.blocks))
    source = np.frombuffer(os.urandom(nbytes), np.uint8)
    fetches: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in caches}
    refs: list[tuple[float, float]] = []
    load = os.getloadavg()[0]
    for _ in range(args.repeat):
        for key, pc in caches.items():
            fetches[key].append(timed(lambda pc=pc: pc.fetch(probe)))
            refs.append(timed(lambda: copy_into_fresh(source)))
    ref, ref_cpu = (statistics.median(t[i] for t in refs) for i in (0, 1))
    print(f"{args.shape}: {nbytes >> 20} MiB, reference {ref * 1e3:.1f} ms (median of {len(refs)})")
    print("| block | run tokens | fetch ms | fetch / ref | cpu / ref cpu | target |")
    print("|---|---|---|---|---|---|")
    for (bs, run), times in fetches.items():
        took, cpu = (statistics.median(t[i] for t in times) for i in (0, 1))
        meets = "met" if took <= 1.2 * ref + 1e-3 else "not met"
        ratios = f"{took / ref:.2f} | {cpu / ref_cpu:.2f}"
        print(f"| {bs} | {run} | {took * 1e3:.1f} | {ratios} | {meets} |")
    print(f"load average (1 min) at start {load:.2f}, at end {os.getloadavg()[0]:.2f}")
    for pc in caches.values():
        pc.close()


if __name__ == "__main__":
    main()
