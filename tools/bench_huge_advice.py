"""A hot restore's huge-page advice, done other ways, in one process.

``memory/huge_pages.advise_huge`` advises each restore buffer's 2 MiB regions
for huge pages and collapses (``MADV_COLLAPSE``) an end region partly in memory.
Here one model-shaped chain (``--shape``, tools/shapes.py) is stored hot at each
``--blocks`` size and fetched round after round with the advice done each
``--ways`` way, alternating within every round, then the reference (the same bytes
copied into ONE fresh numpy buffer, as tools/bench_blocks.py's):

  current        ``advise_huge`` as it is
  off            no advice (``PREFIXCACHE_HUGE_PAGES=0``)
  inside         the regions inside each buffer advised, no collapse of its end regions
  skip-recycled  one ``mincore`` over a buffer's regions first; a buffer all in memory
                 (recycled) gets no advice, the others ``advise_huge``'s

Prints, per block size and way, the medians of the fetch (ms, / the reference, CPU /
the reference's CPU), its page faults, the time spent advising, and the calls made
(``madvise`` / ``MADV_COLLAPSE`` / ``mincore``). Wall times follow the share of the
cores this process gets: read the ways against each other, in one run. Then one
check: a single ``MADV_COLLAPSE`` over four regions (partly in memory, empty, empty,
partly in memory) against one call per partly filled region, and the huge pages
each leaves.

    python tools/bench_huge_advice.py [--shape gpt-oss-20b] [--blocks 16,256]
        [--ways current,off,inside,skip-recycled] [--repeat 7] [--mx-cache-gib 4]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import resource
import statistics
import time

import mlx.core as mx
import numpy as np
from benchlib import huge_bytes_in
from shapes import cache_bytes, filled_cache, model_for, named

import prefixcache.codecs.arrays as arrays_codec
import prefixcache.codecs.buffer as buffer_codec
from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory import huge_pages as rb

HUGE = 2 << 20
PAGES = HUGE // mmap.PAGESIZE
COLLAPSE = 25  # Linux's MADV_COLLAPSE
CALLS = {"madvise": 0, "collapse": 0, "mincore": 0}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class _Counting:
    """libc's madvise and mincore, counted (``huge_pages`` calls them through it)."""

    def madvise(self, addr: int, size: int, advice: int) -> int:
        CALLS["collapse" if advice == COLLAPSE else "madvise"] += 1
        return _libc.madvise(addr, size, advice)

    def mincore(self, addr: int, size: int, pages: int) -> int:
        CALLS["mincore"] += 1
        return _libc.mincore(addr, size, pages)


def _inside(host: np.ndarray) -> None:
    if host.nbytes >= HUGE:
        data = host.ctypes.data
        start, end = -(-data // HUGE) * HUGE, (data + host.nbytes) // HUGE * HUGE
        if end > start:
            rb._libc.madvise(start, end - start, mmap.MADV_HUGEPAGE)


def _skip_recycled(host: np.ndarray) -> None:
    if host.nbytes >= HUGE:
        data = host.ctypes.data
        lo, hi = data // HUGE * HUGE, -(-(data + host.nbytes) // HUGE) * HUGE
        pages = np.empty((hi - lo) // mmap.PAGESIZE, np.uint8)
        if rb._libc.mincore(lo, hi - lo, pages.ctypes.data) == 0 and (pages & 1).all():
            return  # every page in memory: nothing left to fault
    rb.advise_huge(host)


WAYS = {"current": rb.advise_huge, "off": None, "inside": _inside, "skip-recycled": _skip_recycled}
_spent = [0.0]


def _use(way: str) -> None:
    """Make the restore's buffers take the advice ``way``."""
    fn = WAYS[way]
    if fn is None:
        os.environ["PREFIXCACHE_HUGE_PAGES"] = "0"
        fn = rb.advise_huge
    else:
        os.environ.pop("PREFIXCACHE_HUGE_PAGES", None)

    def timed_advice(host: np.ndarray, fn=fn) -> None:
        began = time.perf_counter()
        fn(host)
        _spent[0] += time.perf_counter() - began

    buffer_codec.advise_huge = arrays_codec.advise_huge = timed_advice


def _measure(fn) -> tuple[float, ...]:
    """Wall s, CPU s, page faults, advice s and calls of ``fn()``."""
    gc.collect()
    _spent[0] = 0.0
    for key in CALLS:
        CALLS[key] = 0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    began, cpu = time.perf_counter(), time.process_time()
    fn()
    took, cpu = time.perf_counter() - began, time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return (took, cpu, faults, _spent[0], *CALLS.values())


def _copy_into_fresh(source: np.ndarray) -> None:
    out = np.empty_like(source)
    np.copyto(out, source)


def _caches(args) -> tuple[dict[int, PrefixCache], list[int], np.ndarray]:
    shape = named([args.shape])[0]
    model = model_for(shape)
    tokens = np.random.default_rng(0).integers(0, 512, 4096).tolist()
    caches = {}
    for bs in args.blocks:
        cfg = CacheConfig(block_size=bs, hot_cache_only=True, hot_max_bytes=64 << 30)
        caches[bs] = PrefixCache(model, cfg, model_id="bench")
        filled = filled_cache(shape, model, 4096)
        caches[bs].store(tokens, filled)
    source = np.frombuffer(os.urandom(cache_bytes(filled, 4096, min(args.blocks))), np.uint8)
    return caches, [*tokens, 1], source


def _fetches(args) -> None:
    caches, probe, source = _caches(args)
    rb._libc = _Counting()  # advise_huge calls libc through it
    got = {(bs, w): [] for bs in caches for w in args.ways}
    refs = []
    load = os.getloadavg()[0]
    for turn in range(args.repeat + 1):  # the first round warms up
        for bs, pc in caches.items():
            ways = args.ways if turn % 2 else args.ways[::-1]
            for way in ways:
                _use(way)
                row = _measure(lambda pc=pc: pc.fetch(probe))
                ref = _measure(lambda: _copy_into_fresh(source))
                if turn:
                    got[bs, way].append(row)
                    refs.append(ref)
    ref_ms, ref_cpu, ref_faults = (statistics.median(r[i] for r in refs) for i in range(3))
    print(f"{args.shape}: {source.nbytes >> 20} MiB, reference {ref_ms * 1e3:.1f} ms, ", end="")
    print(f"{ref_faults:.0f} faults; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| block | way | fetch ms | / ref | cpu / ref cpu | faults | advice ms | calls |")
    print("|---|---|---|---|---|---|---|---|")
    for (bs, way), rows in got.items():
        m = [statistics.median(r[i] for r in rows) for i in range(7)]
        calls = " / ".join(f"{v:.0f}" for v in m[4:])
        print(
            f"| {bs} | {way} | {m[0] * 1e3:.1f} | {m[0] / ref_ms:.2f} | {m[1] / ref_cpu:.2f} "
            f"| {m[2]:.0f} | {m[3] * 1e3:.2f} | {calls} |"
        )
    for pc in caches.values():
        pc.close()


def _one_range_collapse(rounds: int) -> None:
    took: dict[str, list[float]] = {"one call per region": [], "one call over four": []}
    huge: dict[str, list[int]] = {k: [] for k in took}
    for _ in range(rounds):
        for way in took:
            mem = mmap.mmap(-1, 6 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = np.frombuffer(mem, np.uint8)
            first = -(-view.ctypes.data // HUGE) * HUGE
            skip = first - view.ctypes.data
            view[skip + 100] = view[skip + 3 * HUGE + 100] = 1  # regions 0 and 3 partly
            _libc.madvise(first, 4 * HUGE, mmap.MADV_HUGEPAGE)
            per = [(first, HUGE), (first + 3 * HUGE, HUGE)]
            calls = per if "per" in way else [(first, 4 * HUGE)]
            began = time.perf_counter()
            for start, size in calls:
                _libc.madvise(start, size, COLLAPSE)
            took[way].append(time.perf_counter() - began)
            huge[way].append(huge_bytes_in(first, 4 * HUGE) // 1024)
            del view
            mem.close()
    for way in took:
        print(
            f"{way}: {statistics.median(took[way]) * 1e6:.0f} us, "
            f"{statistics.median(huge[way]) / 1024:.0f} MiB on huge pages of 4 MiB partly filled"
        )


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="gpt-oss-20b", help="a preset of tools/shapes.py")
    p.add_argument("--blocks", type=lambda s: [int(v) for v in s.split(",")], default=[16, 256])
    p.add_argument("--ways", type=lambda s: s.split(","), default=list(WAYS))
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--mx-cache-gib", type=float, help="MLX's buffer cache limit: freed buffers reused"
    )
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    unknown = [w for w in args.ways if w not in WAYS]
    if unknown:
        raise SystemExit(f"unknown way {unknown[0]!r}: one of {', '.join(WAYS)}")
    if args.mx_cache_gib is not None:
        mx.set_cache_limit(int(args.mx_cache_gib * (1 << 30)))
    _fetches(args)
    _one_range_collapse(args.repeat)


if __name__ == "__main__":
    main()
