"""End-to-end SSD restore benchmark: PrefixCache.fetch from the SSD tier vs raw reads.

Builds a model-shaped cache synthetically (default: 32 layers, 8 kv heads,
head_dim 128, bf16), stores it through a real PrefixCache on the SSD tier
(``hot_max_bytes=1, promote=False``, then ``flush()``), and measures in ONE run,
interleaved and repeated (medians), cold (page cache dropped, as root) and warm:

  seq          ONE file of the same total size read sequentially into a reused
               1 MiB buffer (``dd bs=1M``): what the disk / page cache delivers
  seq_new      that file read whole into fresh memory (``f.read()``): the raw
               read whose result, like a restore's, is the bytes in new RAM
  seq_full     that file read into a reused buffer of its size (already touched)
  files        the payload files themselves into one reused buffer (diagnostic)
  fetch        PrefixCache.fetch of the whole chain (GB/s of payload file
               bytes); the restored cache is dropped before the next run
  fetch_reuse  the same with MLX's buffer cache large enough to keep the freed
               restore buffers (``mx.set_cache_limit``: MLX's default on Metal,
               a setting on the CPU), so no fresh page is touched: vs seq_full

plus the fetch's peak MLX memory above the start against the restored bytes +
one block (the only read buffer is the first block's: a numpy array of one
payload file; every later tensor is read straight into the cache). Ratios are
medians of per-repetition ratios (each against the reference measured in the
same round: the disk drifts), with their range. Each measurement reads its own
copy of the bytes (its own file, payload copies, a second stored chain for
fetch_reuse), once per round. Cold drops the page cache only by default
(``--drop 1``, as after a process restart); ``--drop 3`` drops dentries and
inodes too (as after a reboot: every payload file's metadata is read again).

    python tools/bench_ssd_restore.py --tokens 4096 8192 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import (
    drop_caches,
    read_fresh,
    read_reused,
    shaped_model,
    synthetic_cache,
)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiers.ssd.files import payload_path

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="parent directory (default: system temp)")
    p.add_argument("--drop", type=int, choices=(1, 3), default=1, help="drop_caches level")
    return p


def stored_chain(args, model, tokens: list[int], ssd_dir: str):
    """A PrefixCache holding ``tokens``' blocks on its SSD tier only, and their files."""
    cfg = CacheConfig(
        block_size=args.block_size,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=ssd_dir,
        ssd_min_free_bytes=0,
        write_queue_bytes=256 << 20,
        queue_full="inline",
    )
    pc = PrefixCache(model, cfg, model_id="bench")
    cache = synthetic_cache(args, len(tokens))
    pc.store(tokens, cache)
    pc.flush()
    del cache
    gc.collect()
    metas = sorted(pc.ssd.iter_meta(), key=lambda m: m.index)
    assert len(metas) == len(tokens) // args.block_size, "every block must be on the SSD"
    return pc, metas, [payload_path(f"{ssd_dir}/blocks", m.key) for m in metas]


def copy_files(sources: list[str], dest: str) -> None:
    with open(dest, "wb") as out:
        for path in sources:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, out, 16 * MiB)


def run(args, model, num_tokens: int, work: str) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 512, num_tokens).tolist()
    probe = [*tokens, 1]  # one token to prefill after the hit
    # Each measurement reads its own copy of the bytes, once per round: the VM's host
    # caches what was read recently (a file read twice in a row cold: 0.5 then 2.1 GB/s),
    # so sharing files would favour whichever reads second.
    pc, metas, files = stored_chain(args, model, tokens, f"{work}/ssd")
    pc_reuse, _, reuse_files = stored_chain(args, model, tokens, f"{work}/ssd_reuse")
    total = sum(m.file_bytes for m in metas)
    block_bytes = max(m.nbytes for m in metas)
    seqs = {name: f"{work}/{name}" for name in ("seq", "seq_new", "seq_full")}
    for path in seqs.values():  # one file of the same total size each
        copy_files(files, path)
    raw_files = []
    os.makedirs(f"{work}/files")
    for i, path in enumerate(files):
        raw_files.append(f"{work}/files/{i}")
        copy_files([path], raw_files[-1])
    small, file_buf = bytearray(MiB), bytearray(max(m.file_bytes for m in metas))
    full = np.ones(total, np.uint8)  # touched once, reused
    restored: dict[str, int] = {}

    def fetch(cache: PrefixCache) -> None:
        caches, num = cache.fetch(probe)
        assert num == num_tokens, (num, num_tokens)
        restored["bytes"] = sum(c.keys.nbytes + c.values.nbytes for c in caches)
        del caches

    def fetch_reuse() -> None:
        mx.set_cache_limit(4 * total)
        fetch(pc_reuse)

    readers = {
        "seq": (lambda: read_reused([seqs["seq"]], small), [seqs["seq"]]),
        "seq_new": (lambda: read_fresh([seqs["seq_new"]]), [seqs["seq_new"]]),
        "seq_full": (lambda: read_into(seqs["seq_full"], full), [seqs["seq_full"]]),
        "files": (lambda: read_reused(raw_files, file_buf), raw_files),
        "fetch": (lambda: fetch(pc), files),
        "fetch_reuse": (fetch_reuse, reuse_files),
    }
    default_limit = mx.set_cache_limit(0)
    speed: dict[str, list[float]] = {}
    peaks_mx = []
    for _ in range(args.repeat):
        for mode in ("cold", "warm"):
            for name, (fn, paths) in readers.items():
                mx.set_cache_limit(default_limit)
                if name != "fetch_reuse":
                    mx.clear_cache()  # fresh buffers: nothing left from a reuse run
                if mode == "warm" or name == "fetch_reuse":
                    fn()  # prime the page cache / MLX's buffer cache
                if mode == "cold":
                    drop_caches(paths, args.drop)
                gc.collect()
                base_mx = mx.get_active_memory()
                mx.reset_peak_memory()
                t0 = time.perf_counter()
                fn()
                secs = time.perf_counter() - t0
                speed.setdefault(f"{name}_{mode}", []).append(total / secs / 1e9)
                if name == "fetch":
                    peaks_mx.append(mx.get_peak_memory() - base_mx)
    mx.set_cache_limit(default_limit)
    mx.clear_cache()
    stats = pc.stats()
    pc.close()
    pc_reuse.close()
    out = {name: statistics.median(v) for name, v in speed.items()}
    for mode in ("cold", "warm"):
        for got, ref in RATIOS:
            pairs = zip(speed[f"{got}_{mode}"], speed[f"{ref}_{mode}"], strict=True)
            ratios = [x / y for x, y in pairs]
            out[f"{mode}_{got}_vs_{ref}"] = statistics.median(ratios)
            out[f"{mode}_{got}_vs_{ref}_range"] = f"{min(ratios):.0%}-{max(ratios):.0%}"
    out.update(
        tokens=num_tokens,
        payload_mib=total / MiB,
        block_mib=block_bytes / MiB,
        restored_mib=restored["bytes"] / MiB,
        peak_mx_mib=max(peaks_mx) / MiB,
        budget_mib=(restored["bytes"] + block_bytes) / MiB,
        ssd_block_hits=stats["ssd_block_hits"],
    )
    return out


def read_into(path: str, buf: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while n := f.readinto(view[got:]):
            got += n


RATIOS = [
    ("fetch", "seq_new"),
    ("fetch_reuse", "seq_full"),
    ("fetch", "seq"),
    ("fetch_reuse", "seq"),
    ("fetch", "files"),
]
SPEEDS = ["seq", "seq_new", "seq_full", "files", "fetch", "fetch_reuse"]


def print_table(rows: list[dict[str, float]]) -> None:
    print(
        "\nGB/s of payload file bytes; cold = page cache dropped, warm = from page cache.\n"
        "seq: one file of the same total size into a reused 1 MiB buffer; seq_new: that file\n"
        "into fresh memory (f.read()); seq_full: into a reused, touched buffer of its size;\n"
        "files: the payload files into one reused buffer; fetch: PrefixCache.fetch of the chain\n"
        "from the SSD tier; fetch_reuse: the same with MLX keeping freed buffers for reuse.\n"
        "Ratios: medians of per-repetition ratios (their range). Memory in MiB (fetch):\n"
        "restored cache, cache + one block, MLX peak above the start."
    )
    head = ["tokens", "MiB", "mode", *SPEEDS, *(f"{a}/{b}" for a, b in RATIOS)]
    lines = [head]
    for r in rows:
        for mode in ("cold", "warm"):
            lines.append(
                [f"{r['tokens']:.0f}", f"{r['payload_mib']:.0f}", mode]
                + [f"{r[f'{name}_{mode}']:.2f}" for name in SPEEDS]
                + [
                    f"{r[f'{mode}_{a}_vs_{b}']:.0%} ({r[f'{mode}_{a}_vs_{b}_range']})"
                    for a, b in RATIOS
                ]
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
    print("\ntokens  cache  +1 blk  peak mx")
    for r in rows:
        print(
            f"{r['tokens']:6.0f}  {r['restored_mib']:5.0f}  {r['budget_mib']:6.0f}  "
            f"{r['peak_mx_mib']:7.0f}"
        )


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    rows = []
    for num_tokens in args.tokens:
        work = tempfile.mkdtemp(prefix="bench_ssd_restore_", dir=args.dir)
        try:
            rows.append(row := run(args, model, num_tokens, work))
        finally:
            shutil.rmtree(work)
        print(
            f"{num_tokens} tokens ({row['payload_mib']:.0f} MiB): fetch cold "
            f"{row['fetch_cold']:.2f} GB/s ({row['cold_fetch_vs_seq_new']:.0%} of seq_new, "
            f"{row['cold_fetch_vs_seq']:.0%} of seq) | warm {row['fetch_warm']:.2f} GB/s "
            f"({row['warm_fetch_vs_seq_new']:.0%} of seq_new, {row['warm_fetch_vs_seq']:.0%} of "
            f"seq) | peak {row['peak_mx_mib']:.0f} MiB (cache + 1 block: {row['budget_mib']:.0f})",
            flush=True,
        )
    print_table(rows)


if __name__ == "__main__":
    main()
