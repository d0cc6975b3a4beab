"""The least an SSD fetch of a preset shape can cost on this machine: its own files.

A chain of ``--tokens`` tokens shaped like a preset of tools/shapes.py (default the
Qwen3-Next hybrid: 12 attention layers beside 36 gated-delta-net states) is stored
at each ``--blocks`` size in an SSD tier (run files, the state snapshot in its own
file), then measured warm (page cache), in one run, each round in turn order:

  read       ONE file of the same bytes read into ONE kept buffer (``readinto``):
             bench_blocks' ``--kept-ref`` reference
  ref        the same file read into ONE fresh numpy buffer: bench_blocks' (and
             issue 42's) reference, in whatever memory numpy's allocation gets
  files/N    the tier's own payload files read whole into kept buffers on N
             threads (each takes the next file, largest first), no checksum: the
             copy any restore of these files makes
  hashed/N   the same, each 1 MiB slice hashed (xxh3) as it lands: the verified
             copy, what the fetch's readers do at least
  fresh/N    ``hashed/N`` into buffers made each round as the restore makes its
             own (MLX, unwritten, huge-page advice; one per file, their making
             included): the verified copy into the memory a restore gets
  fetch      ``PrefixCache.fetch`` of the chain (hot empty, no promotion), and
             inside it: ``alloc``, the restore buffers made before the readers
             start (``reserve_ahead``), of which ``load`` is MLX making them (one
             round trip of its IO thread each) and ``advice`` their huge-page
             advice (``advise_huge``: on fresh memory a collapse of a buffer's
             partly filled end regions), and ``start``, the reader threads
             started (``Readers.__init__``); per fetch, means

Per block size: the medians (ms) and the median per-round ratio to ``read``, with
the CPU time (this process, every thread) of the fetch over the read's, and the
fetch's page faults; then the fetch and ``fresh/N`` over ``ref`` and their page
faults, and ``floor / ref``: ``load`` + the best ``hashed/N`` (per round), the
least any restore into new MLX buffers does, over ``ref``. The fetch cannot beat
``alloc`` + the best ``hashed/N`` on this machine, nor ``fresh/N`` by much: where
``floor / ref`` is over 1.5 (the SSD restore target), no restore reaches the
target here. Only names every version of the restore path keeps are wrapped:
``PYTHONPATH`` set to another checkout measures its code the same way. On a
shared machine the thread counts only help while the cores are free: say the load.

    python tools/bench_fetch_floor.py [--shape qwen3-next-80b-a3b | all] [--blocks 16,64,256]
        [--threads 1 2] [--tokens 4096] [--repeat 7] [--mx-cache-gib 4]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import os
import statistics
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np
import xxhash
from benchlib import Clock, read_into_fresh, restore_like_buffers, tier_config
from shapes import model_for, named, stored_chain

from prefixcache import PrefixCache
from prefixcache.cache import restore as restore_module
from prefixcache.codecs import arrays as arrays_codec
from prefixcache.codecs import buffer as buffer_codec
from prefixcache.memory import restore_buffers
from prefixcache.tiers.ssd import readers as readers_module

MiB = 1 << 20
SLICE = MiB  # the readers' read-and-hash step


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shape",
        nargs="+",
        default=["qwen3-next-80b-a3b"],
        help="presets of tools/shapes.py, or all",
    )
    p.add_argument("--blocks", default="16,64,256", help="block sizes, comma-separated")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    p.add_argument(
        "--mx-cache-gib", type=float, default=None, help="MLX's buffer cache limit (its default)"
    )
    return p


def read_files(files: list[tuple[str, np.ndarray]], threads: int, hashed: bool) -> None:
    """Each file whole into its kept buffer, ``threads`` at once taking the next file."""
    todo = iter(files)  # next() is atomic: each file to one thread

    def work() -> None:
        for path, dest in todo:
            fd = os.open(path, os.O_RDONLY)
            try:
                hasher = xxhash.xxh3_64()
                for at in range(0, dest.nbytes, SLICE):
                    view = dest[at : at + SLICE]
                    os.preadv(fd, [view], at)
                    if hashed:
                        hasher.update(view)
            finally:
                os.close(fd)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def read_fresh(paths: list[str], threads: int) -> None:
    """``hashed`` into buffers made as the restore makes its own (MLX, unwritten,
    huge-page advice: fresh or recycled memory, as MLX gives it), one per file."""
    sizes = [os.path.getsize(p) for p in paths]
    dests = restore_like_buffers([(-(-size // 2),) for size in sizes])
    files = [(p, d.view(np.uint8)[:size]) for p, d, size in zip(paths, dests, sizes, strict=True)]
    read_files(files, threads, hashed=True)


def _timed(real, into: list[float], inside: threading.Event):
    """``real`` appending the wall time of each call made while ``inside`` is set
    (a fetch runs: ``fresh/N`` makes its buffers through ``_load`` too) to ``into``."""

    @functools.wraps(real)
    def timed_call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            if inside.is_set():
                into.append(time.perf_counter() - start)

    return timed_call


def timed(fn) -> Clock:
    with Clock() as clock:
        fn()
    return clock


def measure(args, shape, model, block_size: int, root: str) -> dict[str, object]:
    cfg = tier_config("ssd", block_size, os.path.join(root, f"ssd{block_size}"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        probe, _ = stored_chain(pc, shape, model, args.tokens)
        blocks = os.path.join(cfg.ssd_path, "blocks")
        paths = [os.path.join(d, f) for d, _, names in os.walk(blocks) for f in names]
        paths.sort(key=os.path.getsize, reverse=True)
        files = [(p, np.ones(os.path.getsize(p), np.uint8)) for p in paths]
        nbytes = sum(dest.nbytes for _, dest in files)
        one = os.path.join(root, "one.file")
        with open(one, "wb") as f:
            f.write(os.urandom(nbytes))
        kept = np.ones(nbytes, np.uint8)
        parts: dict[str, list[float]] = {"alloc": [], "load": [], "advice": [], "start": []}
        saved = [
            (restore_module, "reserve_ahead", "alloc"),
            (restore_buffers, "_load", "load"),
            (arrays_codec, "advise_huge", "advice"),
            (buffer_codec, "advise_huge", "advice"),
            (readers_module.Readers, "__init__", "start"),
        ]
        saved = [(owner, attr, getattr(owner, attr), part) for owner, attr, part in saved]

        def read() -> None:
            with open(one, "rb", buffering=0) as f:
                f.readinto(memoryview(kept))

        inside = threading.Event()

        def fetch() -> None:
            inside.set()
            try:
                got, num = pc.fetch(probe)
                mx.eval([c.state for c in got])
            finally:
                inside.clear()
            assert num == args.tokens, num

        ways = {
            "read": read,
            "ref": functools.partial(read_into_fresh, one, nbytes),
            "fetch": fetch,
        }
        for n, hashed in itertools.product(args.threads, (False, True)):
            name = f"{'hashed' if hashed else 'files'}/{n}"
            ways[name] = functools.partial(read_files, files, n, hashed)
        for n in args.threads:
            ways[f"fresh/{n}"] = functools.partial(read_fresh, paths, n)
        for owner, attr, real, part in saved:
            setattr(owner, attr, _timed(real, parts[part], inside))
        try:
            for fn in ways.values():  # warm: page cache, MLX's first buffers
                fn()
            for times in parts.values():
                times.clear()
            names = list(ways)
            rounds: dict[str, list[Clock]] = {name: [] for name in names}
            for i in range(args.repeat):
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    gc.collect()  # as bench_blocks: no earlier round's garbage in the way
                    rounds[name].append(timed(ways[name]))
        finally:
            for owner, attr, real, _ in saved:
                setattr(owner, attr, real)
        os.remove(one)
    ref = rounds["read"]
    row: dict[str, object] = {"block": block_size, "files": len(paths), "MiB": nbytes / MiB}
    for name, clocks in rounds.items():
        row[f"{name} ms"] = statistics.median(c.wall for c in clocks) * 1e3
        if name != "read":
            row[f"{name} / read"] = statistics.median(
                c.wall / r.wall for c, r in zip(clocks, ref, strict=True)
            )
    fetches = len(rounds["fetch"])
    for part, times in parts.items():  # each fetch's calls together
        row[f"{part} ms"] = sum(times) / fetches * 1e3
    row["fetch faults"] = int(statistics.median(c.faults for c in rounds["fetch"]))
    row["fetch cpu / read cpu"] = statistics.median(
        c.cpu / r.cpu for c, r in zip(rounds["fetch"], ref, strict=True)
    )
    return row | against_ref(rounds, row["load ms"] / 1e3)


def against_ref(rounds: dict[str, list[Clock]], load: float) -> dict[str, object]:
    """The fetch, ``fresh/N`` and the floor (``load`` + the best ``hashed/N`` of the
    round) over ``ref``, each the median of per-round ratios; page faults of each."""
    ref = rounds["ref"]
    hashed = [clocks for name, clocks in rounds.items() if name.startswith("hashed/")]
    floor = [load + min(c[i].wall for c in hashed) for i in range(len(ref))]
    out: dict[str, object] = {"ref faults": int(statistics.median(c.faults for c in ref))}
    out["floor / ref"] = statistics.median(f / r.wall for f, r in zip(floor, ref, strict=True))
    for name in ["fetch", *(n for n in rounds if n.startswith("fresh/"))]:
        out[f"{name} / ref"] = statistics.median(
            c.wall / r.wall for c, r in zip(rounds[name], ref, strict=True)
        )
    return out


def main() -> None:
    args = setup_arg_parser().parse_args()
    if args.mx_cache_gib is not None:  # freed restore buffers kept for the next fetch
        mx.set_cache_limit(int(args.mx_cache_gib * (1 << 30)))
    rows = []
    for shape in named(args.shape):
        model = model_for(shape)
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            for block_size in (int(b) for b in args.blocks.split(",") if b):
                row = {"shape": shape.name} | measure(args, shape, model, block_size, root)
                rows.append(row)
                print(
                    " ".join(
                        f"{k}={v:.2f}" if type(v) is float else f"{k}={v}" for k, v in row.items()
                    )
                )
    print(f"\n{args.tokens} tokens, medians of {args.repeat}")
    table(rows, list(rows[0]))
    print("\nagainst ref (one read into a fresh numpy buffer), floor = load + best hashed/N:")
    table(
        rows,
        ["shape", "block", "ref ms", "ref faults", "fetch ms", "fetch faults"]
        + [k for k in rows[0] if k.endswith(" / ref")],
    )
    load = os.getloadavg()[0]
    print(f"load average (1 min) at end {load:.2f} on {os.cpu_count()} cores.")


def table(rows: list[dict[str, object]], keys: list[str]) -> None:
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = (f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys)
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
