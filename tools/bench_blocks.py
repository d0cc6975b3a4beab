"""Restore cost against block count, on the cache shapes of real models.

One model-shaped cache (``--shape``: presets of tools/shapes.py, ``all`` for every
one; else ``--layers`` x ``--kv-heads`` x ``--head-dim``, bf16) of ``--tokens`` tokens
is stored at each ``--blocks`` size and restored through ``PrefixCache.fetch``, from
the hot tier and from the SSD tier, alternating with the references, in one run:

  memcpy     the same bytes copied into ONE fresh buffer (numpy ``empty`` +
             ``copyto``: the page faults of fresh memory included; numpy asks
             for huge pages on a buffer this large), the hot restore's reference
  file       ONE file of the same bytes read into ONE fresh buffer
             (``readinto``), the SSD restore's reference (``--kept-ref``: one kept)
  file64     the same file into ONE kept page-aligned buffer: the memory's copy speed
             (numpy's start 16 bytes past a page: tools/bench_read_align.py)

SSD modes: ``warm`` (page cache warm) and ``cold`` (the payload files and the references'
evicted from the page cache before each read: only those). Each round runs the fetch and
its reference back to back, in turn first.

Per shape and block size: the medians of fetch time / reference time (per
round) with their range, the medians of both times, the fixed part of a fetch
(its time minus the reference's), the median of the fetch's CPU time (this
process, every thread) / the reference's (steadier than wall time on a loaded machine), and
whether the median meets its target: hot <= 1.2x memcpy + 1 ms, SSD <= 1.5x
file; SSD rows also the fetch / file64. The load average is printed.

``--base-root DIR`` also runs the same measurements with the prefixcache of
another checkout (``git worktree add DIR COMMIT``), back to back with this one
per shape, each in its own process, and prints both in one table.

    python tools/bench_blocks.py [--shape all] [--blocks 16,32,64,256] [--tiers hot,ssd]
        [--tokens 4096] [--repeat 5] [--modes warm cold] [--base-root DIR] [--kept-ref]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile

import mlx.core as mx
import numpy as np
from bench_read_align import aligned_buffer
from benchlib import (
    Clock,
    add_chain_args,
    evict,
    read_into_fresh,
    rows_in,
    tier_config,
)
from shapes import cache_bytes, custom, filled_cache, model_for, named, shape_from_json, shape_json

from prefixcache import PrefixCache

MiB = 1 << 20


def _csv(kind):
    """An argparse type: one value or a comma-separated list of them."""
    return lambda text: [kind(v) for v in text.split(",") if v]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 5)
    p.add_argument("--blocks", nargs="+", type=_csv(int), help="block sizes: 16,32,64,256")
    p.add_argument("--shape", nargs="+", type=_csv(str), help="presets of tools/shapes.py, all")
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    p.add_argument("--tiers", nargs="+", type=_csv(str), default=[["hot", "ssd"]], help="hot,ssd")
    p.add_argument("--modes", nargs="+", default=["warm"], choices=["warm", "cold"])
    p.add_argument("--base-root", help="a checkout whose prefixcache is measured too")
    p.add_argument(
        "--mx-cache-limit",
        type=lambda v: int(float(v.rstrip("G")) * (1 << 30)) if v.endswith("G") else int(v),
        help="MLX's buffer cache limit (e.g. 4G): freed restore buffers reused, as"
        " Metal's default cache does; default: MLX's (32 MiB on the CPU)",
    )
    p.add_argument("--run-tokens", type=int, help="hot_run_tokens here (not in --base-root)")
    p.add_argument("--kept-ref", action="store_true", help="SSD reference: into one kept buffer")
    p.add_argument("--shape-json", help=argparse.SUPPRESS)  # one shape, from the parent
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # rows, for it
    return p


def memcpy(source: np.ndarray) -> Clock:
    with Clock() as clock:
        out = np.empty_like(source)
        np.copyto(out, source)
    del out
    return clock


def file_read(path: str, nbytes: int, kept: np.ndarray | None = None) -> Clock:
    with Clock() as clock:
        out = read_into_fresh(path, nbytes, kept)
    del out
    return clock


def fetch(pc: PrefixCache, probe: list[int]) -> Clock:
    gc.collect()
    with Clock() as clock:
        cache, num = pc.fetch(probe)
        mx.eval([c.state for c in cache])
    assert num == len(probe) - 1, (num, len(probe))
    del cache
    return clock


def payload_files(ssd_dir: str) -> list[str]:
    blocks = os.path.join(ssd_dir, "blocks")
    return [os.path.join(d, f) for d, _, files in os.walk(blocks) for f in files]


def run(args, shape, model, tier: str, mode: str, block_size: int, root: str) -> dict:
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    cfg = tier_config(tier, block_size, os.path.join(root, f"ssd{block_size}"))
    cfg = cfg if args.run_tokens is None else cfg.replace(hot_run_tokens=args.run_tokens)
    with PrefixCache(model, cfg, model_id="bench") as pc:
        cache = filled_cache(shape, model, args.tokens)
        pc.store(tokens, cache)
        pc.flush()
        nbytes = cache_bytes(cache, args.tokens, block_size)
        source = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        path = os.path.join(root, "one.file")
        with open(path, "wb") as f:
            f.write(source.tobytes())
        del cache
        files = payload_files(cfg.ssd_path) if tier == "ssd" else []
        cold = mode == "cold"
        kept = np.ones(nbytes, np.uint8) if args.kept_ref and tier == "ssd" else None
        paged = aligned_buffer(nbytes) if tier == "ssd" else None

        def reference() -> Clock:
            if tier == "hot":
                return memcpy(source)
            if cold:
                evict([path])
            return file_read(path, nbytes, kept)

        def read64() -> Clock | None:  # SSD rows: the same file into a page-aligned buffer
            if paged is not None and cold:
                evict([path])
            return None if paged is None else file_read(path, nbytes, paged)

        def restore() -> Clock:
            if cold:
                evict(files)
            return fetch(pc, probe)

        fetch(pc, probe)  # warm: the page cache, MLX's first allocations
        rounds = []
        for i in range(args.repeat):
            if i % 2:
                took, ref = restore(), reference()
            else:
                ref, took = reference(), restore()
            rounds.append((took, ref, read64()))
        os.remove(path)
    return _row(shape.name, tier, mode, block_size, args.tokens, nbytes, rounds, len(files))


def _row(name, tier, mode, block_size, num_tokens, nbytes, rounds, files) -> dict[str, object]:
    ratios = [t.wall / r.wall for t, r, _ in rounds]
    fetch_ms = statistics.median(t.wall for t, *_ in rounds) * 1e3
    ref_ms = statistics.median(r.wall for _, r, _ in rounds) * 1e3
    paged = [(t.wall, p.wall) for t, _, p in rounds if p is not None]
    target = 1.2 * ref_ms + 1 if tier == "hot" else 1.5 * ref_ms
    return {
        "shape": name,
        "tier": tier,
        "mode": "-" if tier == "hot" else mode,
        "block": block_size,
        "mib": nbytes / MiB,
        "blocks": num_tokens // block_size,
        "files": files,  # payload files the chain took (ssd_run_tokens)
        "fetch_ms": fetch_ms,
        "ref_ms": ref_ms,
        "ratio": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "over_ms": statistics.median((t.wall - r.wall) * 1e3 for t, r, _ in rounds),
        "cpu_ratio": statistics.median(t.cpu / max(r.cpu, 1e-6) for t, r, _ in rounds),
        "faults": statistics.median(t.faults for t, *_ in rounds),
        "ref_faults": statistics.median(r.faults for _, r, _ in rounds),
        "ref64_ms": statistics.median(p for _, p in paged) * 1e3 if paged else float("nan"),
        "ratio64": statistics.median(t / p for t, p in paged) if paged else float("nan"),
        "target_ms": target,
        "meets": fetch_ms <= target,
    }


def measure(args, shape) -> list[dict[str, object]]:
    """Every tier, mode and block size of one shape, in this process."""
    model = model_for(shape)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for tier in args.tiers:
            for mode in args.modes if tier == "ssd" else ["warm"]:
                for block_size in args.block_sizes:
                    row = run(args, shape, model, tier, mode, block_size, root)
                    rows.append(row)
                    if not args.json:
                        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    return rows


def measure_in(root: str, args, shape, label: str) -> list[dict[str, object]]:
    """``measure`` in a child process importing the prefixcache under ``root``."""
    argv = ["--shape-json", shape_json(shape), "--tokens", str(args.tokens)]
    argv += ["--blocks", ",".join(map(str, args.block_sizes)), "--tiers", ",".join(args.tiers)]
    argv += ["--repeat", str(args.repeat), "--modes", *args.modes]
    if args.mx_cache_limit is not None:
        argv += ["--mx-cache-limit", str(args.mx_cache_limit)]
    argv += (["--dir", args.dir] if args.dir else []) + ["--kept-ref"] * args.kept_ref
    argv += ["--run-tokens", str(args.run_tokens)] if label == "this" and args.run_tokens else []
    rows = rows_in(root, os.path.abspath(__file__), argv)
    for row in rows:
        row["code"] = label
        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    args = setup_arg_parser().parse_args()
    args.blocks, args.shape, args.tiers = (
        [v for values in lists for v in values] if lists else None
        for lists in (args.blocks, args.shape, args.tiers)
    )
    args.block_sizes = args.blocks or args.block_sizes
    if args.mx_cache_limit is not None:
        mx.set_cache_limit(args.mx_cache_limit)
    bad = [t for t in args.tiers if t not in ("hot", "ssd")]
    if bad:
        raise SystemExit(f"--tiers: unknown tier {bad[0]!r} (hot, ssd)")
    if args.shape_json:
        shapes = [shape_from_json(args.shape_json)]
    elif args.shape:
        try:
            shapes = named(args.shape)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    else:
        shapes = [custom(args.layers, args.kv_heads, args.head_dim)]
    if args.json:
        print(json.dumps([row for shape in shapes for row in measure(args, shape)]))
        return
    load = os.getloadavg()
    rows = []
    for shape in shapes:
        if args.base_root:  # back to back: the other checkout's, then this one's
            rows += measure_in(args.base_root, args, shape, "base")
            rows += measure_in(
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))), args, shape, "this"
            )
        else:
            rows += [{**row, "code": "this"} for row in measure(args, shape)]
    print_table(rows, load)


def print_table(rows: list[dict[str, object]], load: tuple[float, ...]) -> None:
    print()
    head = ["shape", "code", "tier", "mode", "block", "blocks", "files", "MiB", "fetch ms"]
    head += ["ref ms", "fetch / ref", "range", "over ms", "cpu / ref cpu", "faults / ref"]
    head += ["target ms", "meets", "ref64 ms", "fetch / ref64"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['code']} | {r['tier']} | {r['mode']} | {r['block']} "
            f"| {r['blocks']} | {r['files']} | {r['mib']:.0f} | {r['fetch_ms']:.1f} "
            f"| {r['ref_ms']:.1f} "
            f"| {r['ratio']:.2f} | {r['lo']:.2f}-{r['hi']:.2f} | {r['over_ms']:.1f} "
            f"| {r['cpu_ratio']:.2f} | {r['faults']:.0f} / {r['ref_faults']:.0f} "
            f"| {r['target_ms']:.1f} | {'yes' if r['meets'] else 'no'} "
            f"| {r['ref64_ms']:.1f} | {r['ratio64']:.2f} |".replace("nan", "-")
        )
    end = os.getloadavg()
    print(
        "\nreference: hot = one memcpy into one fresh buffer; ssd = one file read into one;"
        " over = fetch minus reference (medians); target: hot 1.2x ref + 1 ms, ssd 1.5x ref"
        " (of the medians); faults: page faults of each (a fresh 2 MiB huge page is one,"
        " a fresh 4 KiB page one; pages malloc recycled none), the medians; ref64: the file"
        " into a kept page-aligned buffer (ssd), the memory's copy speed."
        f"\nload average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f}"
        f" on {os.cpu_count()} cores."
    )


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
