"""Where a warm SSD fetch spends its time: the caller's thread, the reader threads.

The chain of tools/bench_blocks.py (8 layers, 8 kv heads, head_dim 128, bf16,
4096 tokens = 128 MiB) is stored at each ``--block-sizes`` on the SSD tier only
and fetched ``--repeat`` times from the page cache. Per fetch, measured in the
fetch itself (medians):

  wall         the fetch, cache evaluated
  cpu          this process's CPU time (every thread)
  readers      CPU time of the SSD reader threads together (their ``_run``)
  caller       CPU time of the caller's thread, split into
    lookup       Lookup.plan: chain keys, the index reads, the token checks
    alloc        the restore buffers sized and allocated from the first header
    blocks       taking the blocks from the stream (ChainLoad.payloads: a run
                 file's at once) and handing them to the builders
                 (_add_block: split by layer, checks)
    rest         the remainder: thread start and join, headroom zeroing, eval

and, in wall time from the fetch's start (where the readers have ``_outcomes``):

  start        until the first reader begins its first run of files (the lookup,
               the buffers, the readers' start: the serial part of a fetch)
  reading      from then until the last reader ends its last run
  tail         from then until the fetch returns, its cache evaluated

and ``file``: ONE file of the same bytes read into fresh memory (wall and CPU),
alternating with the fetches. ``--shape`` profiles a preset of tools/shapes.py
instead (its 4,096-token chain, the bytes its restore copies), ``--mx-cache-limit``
lets MLX keep freed buffers, ``--readers 1 2`` runs each block size with that many
reader threads on a warm chain (``threads``: what the second reader buys). Only names that
every version of the restore path keeps are wrapped, so the same command profiles
the code before a change and after it.

    python tools/bench_ssd_profile.py [--block-sizes 16 32 64 256] [--repeat 9]
        [--shape gpt-oss-20b] [--mx-cache-limit 4G] [--readers 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
from benchlib import add_chain_args, shaped_model, synthetic_cache, tier_config
from shapes import model_for, named, stored_chain

from prefixcache import PrefixCache
from prefixcache.cache import restore as restore_module
from prefixcache.cache.lookup import Lookup
from prefixcache.config import parse_bytes
from prefixcache.tiers.ssd import readers as readers_module

PARTS = ["wall", "cpu", "readers", "caller", "lookup", "alloc", "blocks", "rest"]
PHASES = ["start", "reading", "tail"]
DEFAULT_READERS = readers_module._WARM_READERS


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 9)
    p.add_argument("--dir", default=None)
    p.add_argument("--shape", default=None, help="a preset of tools/shapes.py")
    p.add_argument("--mx-cache-limit", type=parse_bytes, help="MLX's buffer cache limit, e.g. 4G")
    p.add_argument("--readers", type=int, nargs="+", default=[0], help="warm reader threads")
    return p


class Meter:
    """CPU time of the wrapped functions on the thread that runs them."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.runs: list[tuple[float, float]] = []  # each reader run's (start, end), wall
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def wrap(self, owner: object, attr: str, name: str) -> None:
        real: Callable = getattr(owner, attr)

        def timed(*args, **kwargs):
            began = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                self.add(name, time.thread_time() - began)

        setattr(owner, attr, timed)

    def mark_runs(self, owner: object, attr: str) -> None:
        """Record the wall start and end of each call of generator method ``attr``."""
        real: Callable = getattr(owner, attr)

        def marked(*args, **kwargs):
            began = time.perf_counter()
            try:
                yield from real(*args, **kwargs)
            finally:
                with self._lock:
                    self.runs.append((began, time.perf_counter()))

        setattr(owner, attr, marked)


@contextlib.contextmanager
def metered() -> Iterator[Meter]:
    try:  # the streamed blocks' module; an older checkout keeps them in restore
        from prefixcache.cache import streamed as streamed_module
    except ImportError:
        streamed_module = restore_module
    meter = Meter()
    # the loader's verb: a block at a time, or a run of blocks loaded as one unit
    load = "payloads" if hasattr(restore_module.ChainLoad, "payloads") else "payload"
    adds = restore_module if hasattr(restore_module, "_add_block") else streamed_module
    wrapped = [
        (Lookup, "plan", "lookup"),
        (restore_module, "reserve_ahead", "alloc"),
        (adds, "_add_block", "blocks"),
        (restore_module.ChainLoad, load, "blocks"),
        (readers_module.Readers, "_run", "readers"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in wrapped]
    for owner, attr, name in wrapped:
        meter.wrap(owner, attr, name)
    if hasattr(readers_module.Readers, "_outcomes"):
        saved.append((readers_module.Readers, "_outcomes", readers_module.Readers._outcomes))
        meter.mark_runs(readers_module.Readers, "_outcomes")
    try:
        yield meter
    finally:
        for owner, attr, real in saved:
            setattr(owner, attr, real)


def profile(pc: PrefixCache, probe: list[int], meter: Meter) -> dict[str, float]:
    gc.collect()
    meter.cpu.clear()
    meter.runs.clear()
    began, cpu, caller = time.perf_counter(), time.process_time(), time.thread_time()
    cache, num = pc.fetch(probe)
    mx.eval([c.state for c in cache])
    ended, cpu = time.perf_counter(), time.process_time() - cpu
    caller = time.thread_time() - caller
    assert num == len(probe) - 1, (num, len(probe))
    del cache
    out = {"wall": ended - began, "cpu": cpu, "caller": caller, **meter.cpu}
    out["rest"] = caller - sum(meter.cpu.get(k, 0.0) for k in ("lookup", "alloc", "blocks"))
    if meter.runs:
        first, last = min(s for s, _ in meter.runs), max(e for _, e in meter.runs)
        out |= {"start": first - began, "reading": last - first, "tail": ended - last}
    return out


def file_read(path: str, nbytes: int) -> tuple[float, float]:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    out = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(out))
    del out
    return time.perf_counter() - wall, time.process_time() - cpu


def run(args, model, block_size: int, readers: int, root: str) -> dict[str, object]:
    readers_module._WARM_READERS = readers or DEFAULT_READERS
    cfg = tier_config("ssd", block_size, os.path.join(root, f"ssd{block_size}"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        if args.shape:
            probe, nbytes = stored_chain(pc, named([args.shape])[0], model, args.tokens)
        else:
            tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
            probe = [*tokens, 1]
            cache = synthetic_cache(args, args.tokens)
            pc.store(tokens, cache)
            pc.flush()
            nbytes = sum(c.keys[..., : args.tokens, :].nbytes * 2 for c in cache)
            del cache
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
        rows, refs = [], []
        with metered() as meter:
            profile(pc, probe, meter)  # warm: the page cache, first allocations
            for i in range(args.repeat):
                if i % 2:
                    refs.append(file_read(path, nbytes))
                    rows.append(profile(pc, probe, meter))
                else:
                    rows.append(profile(pc, probe, meter))
                    refs.append(file_read(path, nbytes))
        os.remove(path)
    out: dict[str, object] = {"block": block_size, "num_blocks": args.tokens // block_size}
    out["threads"] = readers_module._WARM_READERS
    for part in PARTS + PHASES:
        out[part] = statistics.median(r.get(part, 0.0) for r in rows) * 1e3
    out["file_wall"] = statistics.median(w for w, _ in refs) * 1e3
    out["file_cpu"] = statistics.median(c for _, c in refs) * 1e3
    return out


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = model_for(named([args.shape])[0]) if args.shape else shaped_model(args)
    if args.mx_cache_limit is not None:
        mx.set_cache_limit(args.mx_cache_limit)
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for block_size in args.block_sizes:
            for readers in args.readers:
                rows.append(row := run(args, model, block_size, readers, root))
                print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    head = ["block", "num blocks", "threads", *PARTS, *PHASES, "file wall", "file cpu"]
    print("\nms per fetch (medians); readers, caller and its parts are CPU time, the phases wall")
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        cells = [str(r["block"]), str(r["num_blocks"]), str(r["threads"])]
        cells += [f"{r[k]:.1f}" for k in [*PARTS, *PHASES, "file_wall", "file_cpu"]]
        print("| " + " | ".join(cells) + " |")
    end, cores = os.getloadavg(), os.cpu_count()
    print(f"\nload average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f} on {cores} cores.")


def _fmt(v: object) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
