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
  floor     the replay into buffers of the sizes the fetch restores, made each
            round as the restore makes its own (MLX arrays, huge pages asked
            for: ``benchlib.restore_like_buffers``), their making included, the
            bytes landing in them in order (one iovec per buffer a read spans):
            the least any verified restore into MLX arrays does, with no lookup
            and no placement by layer; over 1.5 x ``read`` in a round, the SSD
            target is out of reach in that round whatever the fetch does
  floor64   ``floor`` with each read landing at its file offset's alignment (a
            little slack per buffer): the floor of a restore whose files and
            buffers were laid out for the kernel's fastest copy
  read64    ``read`` into a kept buffer starting on a page, as the file's bytes
            do: the memory's copy speed. numpy's buffer (``read``) starts 16
            bytes past one, which halves the kernel's copy speed on some CPUs
            (tools/bench_read_align.py)

Where each replayed read lands is laid out before the clock starts (``read_replay``).

Per shape and block: the bytes the fetch read (MiB) against those it restored,
the reads it made, the medians of the times, fetch / read, replay / read,
fetch / replay (what our code adds to its own I/O), fetch / fresh, floor / read and
the rounds in which the floor alone was over 1.5 x read, then read64, the fetch and
both floors over it. A fetch near its replay is bound by the I/O its layout needs;
one well above it has overhead of ours.
``--mx-cache-limit`` as in bench_blocks (freed restore buffers reused).

    python tools/bench_ssd_replay.py [--shape all] [--blocks 16,64,256] [--repeat 5]
        [--mx-cache-limit 4G]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import mlx.core as mx
import numpy as np
from bench_blocks import fetch, file_read
from bench_read_align import aligned_buffer
from benchlib import tier_config
from mlx.utils import tree_flatten
from read_replay import Recorder, Replay
from shapes import RESTORE_SHAPES, model_for, named, stored_chain

from prefixcache import PrefixCache

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["all"], help="presets, or all")
    p.add_argument("--blocks", default="16,64,256", help="block sizes, comma separated")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--mx-cache-limit",
        type=lambda v: int(float(v.rstrip("G")) * (1 << 30)) if v.endswith("G") else int(v),
        help="MLX's buffer cache limit (e.g. 4G); default: MLX's",
    )
    return p


def run(args, shape, model, block_size: int, root: str) -> dict[str, object]:
    cfg = tier_config("ssd", block_size, os.path.join(root, f"ssd{block_size}"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        probe, restored = stored_chain(pc, shape, model, args.tokens)
        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
        sizes = restored_sizes(pc, probe)
        with Recorder() as rec:
            fetch(pc, probe)
        replay = Replay(rec.reads, args.threads)
        nbytes = sum(n for *_, n in rec.reads)
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
        kept = np.ones(nbytes, np.uint8)
        aligned = aligned_buffer(nbytes)
        rounds = []
        for i in range(args.repeat):
            ways = [
                lambda: fetch(pc, probe).wall,
                replay.run,
                lambda: file_read(path, nbytes, kept).wall,
                lambda: replay.run(fresh=True),
                lambda: replay.floor(sizes),
                lambda: file_read(path, nbytes, aligned).wall,
                lambda: replay.floor(sizes, 64),
            ]
            k = i % len(ways)  # rotating order
            took = {(k + j) % len(ways): ways[(k + j) % len(ways)]() for j in range(len(ways))}
            rounds.append([took[j] for j in range(len(ways))])
        os.remove(path)
    med = [statistics.median(r[j] for r in rounds) * 1e3 for j in range(7)]
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
        "floor_ms": med[4],
        "floor_read": statistics.median(r[4] / r[2] for r in rounds),
        "floor_over": sum(r[4] > 1.5 * r[2] for r in rounds),
        "rounds": len(rounds),
        "read64_ms": med[5],
        "fetch_read64": statistics.median(r[0] / r[5] for r in rounds),
        "floor_read64": statistics.median(r[4] / r[5] for r in rounds),
        "floor64_ms": med[6],
        "floor64_read64": statistics.median(r[6] / r[5] for r in rounds),
        "floor64_over": sum(r[6] > 1.5 * r[5] for r in rounds),
    }


def restored_sizes(pc: PrefixCache, probe: list[int]) -> list[int]:
    """The bytes of each buffer a fetch of ``probe`` restores into."""
    cache, _ = pc.fetch(probe)
    sizes = []
    for c in cache:
        keys = getattr(c, "keys", None)
        arrays = (
            [keys, c.values]
            if keys is not None
            else [a for _, a in tree_flatten(c.state) if a is not None]
        )
        sizes += [a.nbytes for a in arrays]
    return sizes


def main() -> None:
    args = setup_arg_parser().parse_args()
    shapes = named(RESTORE_SHAPES if args.shape == ["all"] else args.shape)
    blocks = [int(b) for b in args.blocks.split(",")]
    if args.mx_cache_limit is not None:
        mx.set_cache_limit(args.mx_cache_limit)
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
    head += ["floor ms", "floor / read", "rounds floor > 1.5 read"]
    head += ["read64 ms", "fetch / read64", "floor / read64", "floor64 ms", "floor64 / read64"]
    head += ["rounds floor64 > 1.5 read64"]
    print("\n| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        cells = [r["shape"], r["block"], f"{r['read_mib']:.0f} / {r['restored_mib']:.0f}"]
        cells += [r["reads"]]
        cells += [f"{r[k]:.1f}" for k in ("fetch_ms", "replay_ms", "read_ms", "fresh_ms")]
        ratios = ("fetch_read", "replay_read", "fetch_replay", "fetch_fresh")
        cells += [f"{r[k]:.2f}" for k in ratios]
        cells += [f"{r['floor_ms']:.1f}", f"{r['floor_read']:.2f}"]
        cells += [f"{r['floor_over']} of {r['rounds']}"]
        cells += [f"{r['read64_ms']:.1f}", f"{r['fetch_read64']:.2f}", f"{r['floor_read64']:.2f}"]
        cells += [f"{r['floor64_ms']:.1f}", f"{r['floor64_read64']:.2f}"]
        cells += [f"{r['floor64_over']} of {r['rounds']}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    end, cores = os.getloadavg(), os.cpu_count()
    print(f"\nreplay: {args.threads} threads, kept buffers, hashed as read; read: one file, kept.")
    print(f"load average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f} on {cores} cores.")


def _fmt(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
