"""Hot restores of this checkout against another's, in ONE process, alternating.

The prefixcache of ``--base-root DIR`` (a checkout: ``git worktree add DIR COMMIT``)
is imported beside this one under another name (``prefixcache_base``: the package
imports itself by relative imports only), and one model-shaped cache (``--shape``:
presets of tools/shapes.py) of ``--tokens`` tokens is stored in a hot-only
``PrefixCache`` of each, per block size. Then, round after round, each code's fetch
and the reference (the same bytes copied into ONE fresh numpy buffer, as
tools/bench_blocks.py's hot reference) run back to back, in turn first, so both
codes meet the same memory state and load: the steady before/after where
tools/bench_blocks.py runs each checkout in its own process.

Per shape and block size: the medians of each code's fetch ms, fetch / reference
(per round), the CPU ratio (this process, every thread), and the fetch's fixed cost:
its CPU time (every thread) outside the copies of the blocks' bytes into the restore
buffers (each code's ``codecs.buffer._copy_run`` is timed per call, on whichever
thread runs it, by ``time.thread_time``): making and advising the buffers, the
Python per block and per layer, the evaluations; on a busy machine it moves much
less than wall times do. Two parts of it in wall time: making the restore buffers
(``memory.restore_buffers._load``: one ``mx.load``, whose tensors MLX evaluates one
at a time, each a round trip through its stream and IO threads) and advising them
onto huge pages (``advise_huge``: a collapse faults a region in).

    python tools/bench_hot_ab.py --base-root DIR [--shape gpt-oss-20b llama-3.2-1b]
        [--blocks 16,32,64,256] [--tokens 4096] [--repeat 9]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from shapes import cache_bytes, filled_cache, model_for, named

import prefixcache

BASE = "prefixcache_base"
# seconds: CPU in the copies (every thread); wall in making the restore buffers (one
# ``mx.load`` of an unwritten stream) and in their huge-page advice (on the caller's thread)
_spent = {"copies": 0.0, "buffers": 0.0, "advice": 0.0}
_lock = threading.Lock()


def time_parts(pkg) -> None:
    """Count into ``_spent`` the parts of ``pkg``'s fetches: its copies' CPU
    (``codecs.buffer._copy_run``, on whichever thread), and the wall time of making
    the restore buffers (``memory.restore_buffers._load``) and advising them
    (``advise_huge`` as ``codecs.buffer`` calls it)."""
    buffer = importlib.import_module(pkg.__name__ + ".codecs.buffer")
    buffers = importlib.import_module(pkg.__name__ + ".memory.restore_buffers")
    for module, name, part, clock in (
        (buffer, "_copy_run", "copies", time.thread_time),
        (buffers, "_load", "buffers", time.perf_counter),
        (buffer, "advise_huge", "advice", time.perf_counter),
    ):
        fn = getattr(module, name, None)
        if fn is not None:  # an older checkout may lack it: that part counts nothing
            setattr(module, name, _timed_part(fn, part, clock))


def _timed_part(fn, part: str, clock):
    def timed_fn(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _spent[part] += clock() - start

    return timed_fn


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-root", required=True, help="a checkout whose prefixcache is the base")
    p.add_argument("--shape", nargs="+", default=["gpt-oss-20b", "llama-3.2-1b"])
    p.add_argument("--blocks", type=_ints, default=[16, 32, 64, 256], help="block sizes: 16,32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=9)
    return p


def import_base(root: str):
    """The prefixcache package of checkout ``root``, imported as ``prefixcache_base``."""
    pkg = Path(root) / "prefixcache"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"--base-root {root!r} has no prefixcache package")
    spec = importlib.util.spec_from_file_location(
        BASE, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[BASE] = module
    spec.loader.exec_module(module)
    return module


def timed(fn) -> tuple[float, ...]:
    """Seconds of ``fn()``: wall, process CPU, CPU outside the copies, making the
    buffers, advising them."""
    gc.collect()
    before = dict(_spent)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    spent = {k: v - before[k] for k, v in _spent.items()}
    return wall, cpu, cpu - spent["copies"], spent["buffers"], spent["advice"]


def copy_into_fresh(source: np.ndarray) -> None:
    out = np.empty_like(source)
    np.copyto(out, source)


def run_shape(name: str, args, codes: dict[str, object]) -> list[str]:
    shape = named([name])[0]
    model = model_for(shape)
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    rows = []
    for bs in args.blocks:
        caches = {}
        for code, pkg in codes.items():
            cfg = pkg.CacheConfig(block_size=bs, hot_cache_only=True, hot_max_bytes=64 << 30)
            caches[code] = pkg.PrefixCache(model, cfg, model_id="bench")
            filled = filled_cache(shape, model, args.tokens)
            caches[code].store(tokens, filled)
        source = np.frombuffer(os.urandom(cache_bytes(filled, args.tokens, bs)), np.uint8)
        for pc in caches.values():  # a first fetch makes the host views
            pc.fetch(probe)
        pairs = {code: [] for code in caches}  # (fetch, the reference run after it)
        order = list(caches)
        for r in range(args.repeat):
            for code in order if r % 2 == 0 else order[::-1]:
                took = timed(lambda pc=caches[code]: pc.fetch(probe))
                pairs[code].append((took, timed(lambda source=source: copy_into_fresh(source))))
        refs = [ref for code in order for _, ref in pairs[code]]
        ref, ref_cpu = (statistics.median(t[i] for t in refs) for i in range(2))
        for code, pc in caches.items():
            pc.close()
            ts = [t for t, _ in pairs[code]]
            ratio = statistics.median(t[0] / r[0] for t, r in pairs[code])
            took, cpu, own, made, advised = (statistics.median(t[i] for t in ts) for i in range(5))
            target = "met" if took <= 1.2 * ref + 1e-3 else "not met"
            rows.append(
                f"| {name} | {bs} | {code} | {took * 1e3:.1f} | {ref * 1e3:.1f} | {ratio:.2f} "
                f"| {cpu / ref_cpu:.2f} | {own * 1e3:.2f} | {made * 1e3:.2f} | {advised * 1e3:.2f} "
                f"| {target} |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    args = setup_arg_parser().parse_args()
    try:
        named(args.shape)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    codes = {"base": import_base(args.base_root), "this": prefixcache}
    for pkg in codes.values():
        time_parts(pkg)
    load = os.getloadavg()[0]
    header = (
        "| shape | block | code | fetch ms | ref ms | fetch / ref | cpu / ref cpu "
        "| CPU outside copies ms | buffers ms | advice ms | target |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header)
    rows = [row for name in args.shape for row in run_shape(name, args, codes)]
    print("\n" + header + "\n" + "\n".join(rows))
    print(f"load average (1 min) at start {load:.2f}, at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
