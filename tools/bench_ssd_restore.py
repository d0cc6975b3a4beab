"""End-to-end SSD restore benchmark: PrefixCache.fetch from the SSD tier vs raw reads.

Builds a model-shaped cache synthetically (default: 32 layers, 8 kv heads,
head_dim 128, bf16), stores it through a real PrefixCache on the SSD tier
(``hot_max_bytes=1, promote=False``, then ``flush()``), and measures in ONE run,
interleaved and repeated (medians), cold (page cache dropped, as root) and warm:

  seq         sequential read of ONE file of the same total size, 1 MiB reused
              buffer (``dd bs=1M``): the disk / page-cache reference
  files       read of the payload files themselves, in chain order, into one
              reused buffer: the same I/O the fetch has to do, nothing else
  files_new   the payload files read into fresh memory (``f.read()``)
  fetch       PrefixCache.fetch of the whole chain (GB/s of payload file bytes);
              the restored cache is dropped before the next run

plus the fetch's peak memory (MLX peak above the start, and the process's
peak RSS above the start) against the restored bytes + one block. Ratios are
medians of per-repetition ratios (each against the reference measured just
before it: the disk drifts).

    python tools/bench_ssd_restore.py --tokens 4096 8192 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import (
    drop_caches,
    peak_rss,
    read_fresh,
    reset_peak_rss,
    rss,
    shaped_model,
    synthetic_cache,
)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.payload import payload_path

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
    p.add_argument(
        "--mx-cache-limit",
        type=int,
        default=None,
        metavar="MIB",
        help="mx.set_cache_limit: let MLX keep freed buffers (a server's steady state)",
    )
    return p


def read_reused(paths: list[str], buf: bytearray) -> None:
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def run(args, model, num_tokens: int, work: str) -> dict[str, float]:
    cfg = CacheConfig(
        block_size=args.block_size,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=f"{work}/ssd",
        ssd_min_free_bytes=0,
        write_queue_bytes=256 << 20,
        queue_full="inline",
    )
    tokens = np.random.default_rng(0).integers(0, 512, num_tokens).tolist()
    probe = [*tokens, 1]  # one token to prefill after the hit
    pc = PrefixCache(model, cfg, model_id="bench")
    cache = synthetic_cache(args, num_tokens)
    pc.store(tokens, cache)
    pc.flush()
    del cache
    gc.collect()
    metas = sorted(pc.ssd.iter_meta(), key=lambda m: m.index)
    assert len(metas) == num_tokens // args.block_size, "every block must be on the SSD"
    files = [payload_path(f"{work}/ssd/blocks", m.key) for m in metas]
    total = sum(m.file_bytes for m in metas)
    block_bytes = max(m.nbytes for m in metas)
    with open(f"{work}/seq", "wb") as out:  # one file of the same total size
        for path in files:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, out, 16 * MiB)
    seq_buf, file_buf = bytearray(MiB), bytearray(max(m.file_bytes for m in metas))
    restored: dict[str, int] = {}

    def fetch() -> None:
        caches, num = pc.fetch(probe)
        assert num == num_tokens, (num, num_tokens)
        restored["bytes"] = sum(c.keys.nbytes + c.values.nbytes for c in caches)
        del caches

    readers = {
        "seq": lambda: read_reused([f"{work}/seq"], seq_buf),
        "files": lambda: read_reused(files, file_buf),
        "files_new": lambda: read_fresh(files),
        "fetch": fetch,
    }
    speed: dict[str, list[float]] = {}
    peaks_mx, peaks_rss = [], []
    for _ in range(args.repeat):
        for mode in ("cold", "warm"):
            for name, fn in readers.items():
                if mode == "cold":
                    drop_caches([f"{work}/seq", *files])
                else:
                    fn()  # prime the page cache
                gc.collect()
                base_mx, base_rss = mx.get_active_memory(), rss()
                mx.reset_peak_memory()
                reset_peak_rss()
                t0 = time.perf_counter()
                fn()
                secs = time.perf_counter() - t0
                speed.setdefault(f"{name}_{mode}", []).append(total / secs / 1e9)
                if name == "fetch":
                    peaks_mx.append(mx.get_peak_memory() - base_mx)
                    peaks_rss.append(peak_rss() - base_rss)
    stats = pc.stats()
    pc.close()
    out = {name: statistics.median(v) for name, v in speed.items()}
    for mode in ("cold", "warm"):
        for ref in ("seq", "files", "files_new"):
            pairs = zip(speed[f"fetch_{mode}"], speed[f"{ref}_{mode}"], strict=True)
            out[f"{mode}_vs_{ref}"] = statistics.median(x / y for x, y in pairs)
    out.update(
        tokens=num_tokens,
        payload_mib=total / MiB,
        block_mib=block_bytes / MiB,
        restored_mib=restored["bytes"] / MiB,
        peak_mx_mib=max(peaks_mx) / MiB,
        peak_rss_mib=max(peaks_rss) / MiB,
        budget_mib=(restored["bytes"] + block_bytes) / MiB,
        ssd_block_hits=stats["ssd_block_hits"],
    )
    return out


COLUMNS = [  # (key, header, format)
    ("tokens", "tokens", "{:.0f}"), ("payload_mib", "MiB", "{:.0f}"),
    ("seq_cold", "seq", "{:.2f}"), ("files_cold", "files", "{:.2f}"),
    ("files_new_cold", "files_new", "{:.2f}"), ("fetch_cold", "fetch", "{:.2f}"),
    ("seq_warm", "seq", "{:.2f}"), ("files_warm", "files", "{:.2f}"),
    ("files_new_warm", "files_new", "{:.2f}"), ("fetch_warm", "fetch", "{:.2f}"),
    ("cold_vs_seq", "c/seq", "{:.0%}"), ("cold_vs_files", "c/files", "{:.0%}"),
    ("warm_vs_seq", "w/seq", "{:.0%}"), ("warm_vs_files", "w/files", "{:.0%}"),
    ("warm_vs_files_new", "w/new", "{:.0%}"),
    ("restored_mib", "cache", "{:.0f}"), ("budget_mib", "+1 blk", "{:.0f}"),
    ("peak_mx_mib", "peak mx", "{:.0f}"), ("peak_rss_mib", "peak rss", "{:.0f}"),
]  # fmt: skip


def print_table(rows: list[dict[str, float]]) -> None:
    print(
        "\nGB/s of payload file bytes; cold = page cache dropped, warm = from page cache.\n"
        "seq: one file of the same total size (1 MiB reused buffer); files: the payload files\n"
        "into one reused buffer; files_new: the payload files into fresh memory (f.read());\n"
        "fetch: PrefixCache.fetch of the chain from the SSD tier. Ratios: fetch vs reference\n"
        "(median of per-repetition ratios). Memory in MiB: restored cache, cache + one block,\n"
        "fetch peak above the start (MLX allocations; process RSS incl. host read buffers)."
    )
    head = [h for _, h, _ in COLUMNS]
    lines = [head, ["", "", *["cold"] * 4, *["warm"] * 4, *["ratio"] * 5, *["memory"] * 4]]
    lines += [[fmt.format(r[key]) for key, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def main() -> None:
    args = setup_arg_parser().parse_args()
    if args.mx_cache_limit is not None:
        mx.set_cache_limit(args.mx_cache_limit * MiB)
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
            f"{row['fetch_cold']:.2f} GB/s ({row['cold_vs_seq']:.0%} of seq, "
            f"{row['cold_vs_files']:.0%} of files) | warm {row['fetch_warm']:.2f} GB/s "
            f"({row['warm_vs_seq']:.0%} of seq, {row['warm_vs_files']:.0%} of files) | "
            f"peak {row['peak_mx_mib']:.0f} MiB (cache + 1 block: {row['budget_mib']:.0f})",
            flush=True,
        )
    print_table(rows)


if __name__ == "__main__":
    main()
