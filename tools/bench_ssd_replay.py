"""A warm SSD fetch against replaying its own reads: how much is I/O, how much is ours.

One model-shaped chain (``--shape``: presets of tools/shapes.py) of ``--tokens``
tokens is stored at each ``--blocks`` size on the SSD tier only. One fetch is
recorded: every read it makes (file, offset, bytes; the page-cache probes of
one byte left out). Then, alternating in one process, each round:

  fetch     ``PrefixCache.fetch`` of the chain from the SSD tier (page cache warm)
  replay    the recorded reads on ``--threads`` threads (each a contiguous share,
            in file order), each into a buffer kept across rounds and hashed
            (xxh3-64) as it lands: the reads and the verification the fetch
            cannot skip, with no placement, buffers or Python of ours
  read      ONE file of the bytes the fetch read, into ONE kept buffer
  fresh     the replay into new buffers each round (numpy's ``empty``, as the
            fetch's restore buffers are new): the page faults of fresh memory

Per shape and block: the bytes the fetch read (MiB) against those it restored,
the reads it made, the medians of the three times, fetch / read, replay / read
fetch / replay (what our code adds to its own I/O) and fetch / fresh. A fetch near its replay
is bound by the I/O its layout needs; one well above it has overhead of ours.

    python tools/bench_ssd_replay.py [--shape all] [--blocks 16,64,256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np
import xxhash
from bench_blocks import fetch, file_read
from benchlib import tier_config
from shapes import RESTORE_SHAPES, model_for, named, stored_chain

from prefixcache import PrefixCache

MiB = 1 << 20
Read = tuple[str, int, int]  # path, offset, bytes


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["all"], help="presets, or all")
    p.add_argument("--blocks", default="16,64,256", help="block sizes, comma separated")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None)
    return p


class Recorder:
    """Every ``os.preadv`` / ``os.pread`` of more than one byte while active."""

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self._lock = threading.Lock()
        self._real = (os.preadv, os.pread)

    def __enter__(self) -> Recorder:
        preadv, pread = self._real

        def rec_preadv(fd, buffers, offset, *flags):
            n = preadv(fd, buffers, offset, *flags)
            self._add(fd, offset, n)
            return n

        def rec_pread(fd, length, offset):
            data = pread(fd, length, offset)
            self._add(fd, offset, len(data))
            return data

        os.preadv, os.pread = rec_preadv, rec_pread
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv, os.pread = self._real

    def _add(self, fd: int, offset: int, n: int) -> None:
        if n > 1:
            path = os.readlink(f"/proc/self/fd/{fd}")
            with self._lock:
                self.reads.append((path, offset, n))


class Replay:
    """The recorded reads in file order, cut into ``threads`` contiguous shares,
    each read into its kept buffer and hashed."""

    def __init__(self, reads: list[Read], threads: int) -> None:
        reads = sorted(reads)
        total = sum(n for *_, n in reads)
        self.shares: list[list[Read]] = [[] for _ in range(threads)]
        done = 0
        for r in reads:
            self.shares[min(threads - 1, done * threads // max(total, 1))].append(r)
            done += r[2]
        self.bufs = [np.ones(max(sum(n for *_, n in s), 1), np.uint8) for s in self.shares]

    def run(self, fresh: bool = False) -> float:
        """Seconds to replay; ``fresh``: into new buffers (numpy's), not the kept ones."""
        began = time.perf_counter()
        bufs = [np.empty_like(b) for b in self.bufs] if fresh else self.bufs
        threads = [
            threading.Thread(target=_replay, args=(s, b))
            for s, b in zip(self.shares, bufs, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - began


def _replay(reads: list[Read], buf: np.ndarray) -> None:
    fds: dict[str, int] = {}
    hasher = xxhash.xxh3_64()
    at = 0
    try:
        for path, offset, n in reads:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            view = buf[at : at + n]
            os.preadv(fd, [view], offset)
            hasher.update(view)
            at += n
    finally:
        for fd in fds.values():
            os.close(fd)


def run(args, shape, model, block_size: int, root: str) -> dict[str, object]:
    cfg = tier_config("ssd", block_size, os.path.join(root, f"ssd{block_size}"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        probe, restored = stored_chain(pc, shape, model, args.tokens)
        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
        with Recorder() as rec:
            fetch(pc, probe)
        replay = Replay(rec.reads, args.threads)
        nbytes = sum(n for *_, n in rec.reads)
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
        kept = np.ones(nbytes, np.uint8)
        rounds = []
        for i in range(args.repeat):
            ways = [
                lambda: fetch(pc, probe).wall,
                replay.run,
                lambda: file_read(path, nbytes, kept).wall,
                lambda: replay.run(fresh=True),
            ]
            k = i % len(ways)  # rotating order
            took = {(k + j) % len(ways): ways[(k + j) % len(ways)]() for j in range(len(ways))}
            rounds.append([took[j] for j in range(len(ways))])
        os.remove(path)
    med = [statistics.median(r[j] for r in rounds) * 1e3 for j in range(4)]
    return {
        "shape": shape.name,
        "block": block_size,
        "read_mib": nbytes / MiB,
        "restored_mib": restored / MiB,
        "reads": len(rec.reads),
        "fetch_ms": med[0],
        "replay_ms": med[1],
        "read_ms": med[2],
        "fresh_ms": med[3],
        "fetch_read": statistics.median(r[0] / r[2] for r in rounds),
        "replay_read": statistics.median(r[1] / r[2] for r in rounds),
        "fetch_replay": statistics.median(r[0] / r[1] for r in rounds),
        "fetch_fresh": statistics.median(r[0] / r[3] for r in rounds),
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    shapes = named(RESTORE_SHAPES if args.shape == ["all"] else args.shape)
    blocks = [int(b) for b in args.blocks.split(",")]
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for shape in shapes:
            model = model_for(shape)
            for block_size in blocks:
                rows.append(row := run(args, shape, model, block_size, root))
                print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
            del model
            mx.clear_cache()
    head = ["shape", "block", "MiB read / restored", "reads", "fetch ms", "replay ms", "read ms"]
    head += ["fresh ms", "fetch / read", "replay / read", "fetch / replay", "fetch / fresh"]
    print("\n| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        cells = [r["shape"], r["block"], f"{r['read_mib']:.0f} / {r['restored_mib']:.0f}"]
        cells += [r["reads"]]
        cells += [f"{r[k]:.1f}" for k in ("fetch_ms", "replay_ms", "read_ms", "fresh_ms")]
        ratios = ("fetch_read", "replay_read", "fetch_replay", "fetch_fresh")
        cells += [f"{r[k]:.2f}" for k in ratios]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    end, cores = os.getloadavg(), os.cpu_count()
    print(f"\nreplay: {args.threads} threads, kept buffers, hashed as read; read: one file, kept.")
    print(f"load average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f} on {cores} cores.")


def _fmt(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
