"""SSD tier benchmark: load and write throughput against the raw disk, in one run.

For each block shape (layers x kv_heads x tokens x head_dim, K and V, bf16) it
writes N blocks (~``--total-mib`` MiB) and measures, interleaved and repeated
(median), with the page cache dropped (cold) and primed (warm):

  raw_seq     sequential read of ONE file of the same total size (reused buffer):
              the disk / page-cache reference of the 70 % target
  raw_files   read of each payload-sized file into fresh memory (``f.read()``)
  load        SsdTier.load (index lookup, read, xxh3 verify, fresh mx.arrays),
              with the reader it picks by size (payload.SMALL_PAYLOAD)
  stream      SsdTier.load in chain order, with kernel readahead of the next blocks
  buf_load    the "buffer" reader forced: read whole file, verify, one copy into MLX
  mxl_load    the "mx_load" reader forced: mx.load, then verify
  lmdb_load   payloads stored as LMDB values instead of files: zero-copy get,
              verify, one copy into MLX (the best reader for that layout)
  raw_write   write + fsync of N files of the same size (reference)
  writer      SsdTier.put of all blocks until flush() returns (background writer)
  lmdb_write  the same payloads as LMDB values, one synced commit per block
  put_us      caller-side cost of one put() (median)

and the open time of a directory holding ``--open-blocks`` blocks (cold and warm).

    python tools/bench_ssd.py                  # 32, 8 and 5.6 MiB blocks (8B, 1B, 135M models)
    python tools/bench_ssd.py --shapes 32x8x256x128 --total-mib 512 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import xxhash
from bench_ssd_table import print_table
from benchlib import drop_caches, read_fresh, read_reused, readahead
from lmdb_payloads import lmdb_load, lmdb_write

from prefixcache.blocks import Block
from prefixcache.config import CacheConfig
from prefixcache.memory.host import tensors_of
from prefixcache.tiers.ssd.files import payload_path
from prefixcache.tiers.ssd.payload import encode_header, read_payload
from prefixcache.tiers.ssd.tier import SsdTier

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["32x8x256x128", "16x8x256x64", "30x3x256x64"])
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per shape")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--open-blocks", type=int, default=10_000, help="0: skip the open test")
    p.add_argument("--dir", default=None, help="parent directory (default: system temp)")
    return p


def make_blocks(shape: str, num: int) -> list[Block]:
    """``num`` chained blocks sharing one set of random arrays (distinct keys)."""
    layers, heads, tokens, dim = (int(x) for x in shape.split("x"))
    arrays = {
        f"{layer}.{kv}": mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16)
        for layer in range(layers)
        for kv in ("keys", "values")
    }  # (B, kv_heads, T, head_dim)
    mx.eval(arrays)
    blocks, parent = [], b"\0" * 16
    toks = np.arange(tokens, dtype="<u4").tobytes()
    for i in range(num):
        key = xxhash.xxh3_128_digest(f"{shape}/{i}".encode())
        blocks.append(Block.make(key, parent, b"\0" * 16, i, toks, arrays))
        parent = key
    return blocks


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def consume(blocks) -> None:
    """Drop each block before the next, as a restore streaming into its buffer does."""
    for _ in blocks:
        pass


def stream(tier: SsdTier, keys: list[bytes], ahead: int = 4) -> Iterator[Block | None]:
    """Load blocks in order (a chain being restored), one at a time; the payload files
    of the next ``ahead`` blocks are handed to the kernel's readahead meanwhile."""
    readahead([tier.payload_file(k) for k in keys[:ahead]])
    for i, key in enumerate(keys):
        readahead([tier.payload_file(k) for k in keys[i + ahead : i + ahead + 1]])
        yield tier.load(key)


def forced_load(tier: SsdTier, keys: list[bytes], reader: str) -> None:
    for key in keys:
        meta = tier.get_meta(key)
        path = payload_path(os.path.join(tier.path, "blocks"), key)
        read_payload(path, key, meta.file_bytes, meta.checksum, reader=reader)


def write_refs(blocks: list[Block], work: str) -> dict[str, float]:
    """Raw files + fsync, the SSD writer, and LMDB-stored payloads; seconds each."""
    image = encode_header(tensors_of(blocks[0].arrays), blocks[0].key)
    image += b"".join(t.data for t in tensors_of(blocks[0].arrays))
    os.makedirs(f"{work}/raw", exist_ok=True)

    def raw_write() -> None:
        for i in range(len(blocks)):
            fd = os.open(f"{work}/raw/{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, image)
            os.fsync(fd)
            os.close(fd)

    out = {"raw_write": seconds(raw_write)}
    total = sum(b.nbytes for b in blocks)
    tier = SsdTier(
        CacheConfig(
            ssd_dir=f"{work}/ssd",
            ssd_max_bytes=1 << 50,
            write_queue_bytes=total + 1,
            ssd_min_free_bytes=0,
        )
    )
    put_times = []
    start = time.perf_counter()
    for block in blocks:
        put_times.append(seconds(lambda b=block: tier.put(b)))
    tier.flush()
    out["writer"] = time.perf_counter() - start
    out["put_us"] = statistics.median(put_times) * 1e6
    tier.close()
    out["lmdb_write"] = lmdb_write(blocks, f"{work}/lmdb")
    return out


def read_all(blocks: list[Block], work: str, repeat: int, total: int) -> dict[str, float]:
    """GB/s of each reader, cold and warm, interleaved (medians over ``repeat``).

    Ratios ``load_{mode}_vs_{ref}`` are medians of per-repetition ratios, each
    taken against the reference measured just before: the disk drifts.
    """
    tier = SsdTier(CacheConfig(ssd_dir=f"{work}/ssd", ssd_max_bytes=1 << 50, ssd_min_free_bytes=0))
    keys = [b.key for b in blocks]
    sums = {k: tier.get_meta(k).checksum for k in keys}
    files = [payload_path(f"{work}/ssd/blocks", k) for k in keys]
    with open(f"{work}/seq", "wb") as f:  # one file of the same total size
        for path in files:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 16 * MiB)
    readers = {
        "raw_seq": lambda: read_reused([f"{work}/seq"], bytearray(MiB)),
        "raw_files": lambda: read_fresh(files),
        "load": lambda: consume(tier.load(k) for k in keys),
        "stream": lambda: consume(stream(tier.reads, keys)),
        "buf_load": lambda: forced_load(tier, keys, "buffer"),
        "mxl_load": lambda: forced_load(tier, keys, "mx_load"),
        "lmdb_load": lambda: lmdb_load(f"{work}/lmdb", keys, sums),
    }
    all_paths = [f"{work}/seq", *files, f"{work}/lmdb/data.mdb"]
    speed: dict[str, list[float]] = {}
    for _ in range(repeat):
        for mode in ("cold", "warm"):
            for name, fn in readers.items():
                if mode == "cold":
                    drop_caches(all_paths)
                else:
                    fn()  # prime the page cache (and the allocator)
                speed.setdefault(f"{name}_{mode}", []).append(total / seconds(fn) / 1e9)
    tier.close()
    out = {name: statistics.median(v) for name, v in speed.items()}
    for mode in ("cold", "warm"):
        for ref in ("raw_seq", "raw_files"):
            pairs = zip(speed[f"stream_{mode}"], speed[f"{ref}_{mode}"], strict=True)
            out[f"stream_{mode}_vs_{ref}"] = statistics.median(x / y for x, y in pairs)
    return out


def bench_shape(shape: str, args: argparse.Namespace, work: str) -> dict[str, float]:
    one = make_blocks(shape, 1)[0]
    num = max(4, args.total_mib * MiB // one.nbytes)
    blocks = make_blocks(shape, num)
    total = len(blocks) * (one.nbytes + len(encode_header(tensors_of(one.arrays), one.key)))
    row: dict[str, float] = {"block_mib": one.nbytes / MiB, "num": num}
    for name, secs in write_refs(blocks, work).items():
        row[name] = secs if name == "put_us" else total / secs / 1e9
    row.update(read_all(blocks, work, args.repeat, total))
    return row


def bench_open(num: int, work: str) -> dict[str, float]:
    """Open (+ stats) of a directory holding ``num`` small blocks."""
    template = make_blocks("2x2x16x64", 1)[0]
    tier = SsdTier(
        CacheConfig(
            ssd_dir=f"{work}/open",
            ssd_max_bytes=1 << 50,
            write_queue_bytes=1 << 30,
            ssd_min_free_bytes=0,
        )
    )
    start = time.perf_counter()
    for i in range(num):
        key = xxhash.xxh3_128_digest(b"open/%d" % i)
        tier.put(Block(key, b"\0" * 16, b"\0" * 16, 0, template.tokens, template.arrays))
    tier.close()
    out = {"build_s": time.perf_counter() - start}
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_caches([f"{work}/open/index/data.mdb"])
        start = time.perf_counter()
        tier = SsdTier(
            CacheConfig(ssd_dir=f"{work}/open", ssd_max_bytes=1 << 50, ssd_min_free_bytes=0)
        )
        assert tier.stats()["num_blocks"] == num
        out[f"open_{mode}_ms"] = (time.perf_counter() - start) * 1e3
        tier.close()
    return out


def main() -> None:
    args = setup_arg_parser().parse_args()
    rows = {}
    for shape in args.shapes:
        work = tempfile.mkdtemp(prefix="bench_ssd_", dir=args.dir)
        try:
            rows[shape] = row = bench_shape(shape, args, work)
        finally:
            shutil.rmtree(work)
        print(
            f"{shape}: block {row['block_mib']:.1f} MiB x {row['num']:.0f} | "
            f"cold stream {row['stream_cold']:.2f} vs raw {row['raw_seq_cold']:.2f} GB/s "
            f"({row['stream_cold_vs_raw_seq']:.0%}) | "
            f"warm stream {row['stream_warm']:.2f} vs raw {row['raw_seq_warm']:.2f} GB/s "
            f"({row['stream_warm_vs_raw_seq']:.0%}; vs fresh-memory reads "
            f"{row['stream_warm_vs_raw_files']:.0%}) | "
            f"writer {row['writer']:.2f} vs raw write {row['raw_write']:.2f} GB/s | "
            f"put {row['put_us']:.0f} us",
            flush=True,
        )
    if args.open_blocks:
        work = tempfile.mkdtemp(prefix="bench_ssd_open_", dir=args.dir)
        try:
            res = bench_open(args.open_blocks, work)
        finally:
            shutil.rmtree(work)
        print(
            f"open of {args.open_blocks} blocks: cold {res['open_cold_ms']:.1f} ms, "
            f"warm {res['open_warm_ms']:.1f} ms (built in {res['build_s']:.1f} s, "
            f"{args.open_blocks / res['build_s']:.0f} small blocks/s)",
            flush=True,
        )
    print_table(rows)


if __name__ == "__main__":
    main()
