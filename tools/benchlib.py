"""Pieces the benchmarks share: the chain's shape and tiers, a model-shaped cache,
page-cache dropping and readahead, RSS.

Imported by the scripts beside it (``python tools/bench_*.py`` puts tools/ on sys.path).
"""

from __future__ import annotations

import os
import random
import resource
import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory.host import host_view
from prefixcache.memory.restore_buffers import batched, resolve
from prefixcache.tiny.models import build_model


def add_chain_args(p, block_sizes: list[int], repeat: int) -> None:
    """The chain's shape (default: 8 layers, 8 kv heads, head_dim 128, bf16: 32 KiB
    per token, 4096 tokens = 128 MiB), its block sizes and the rounds."""
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-sizes", type=int, nargs="+", default=block_sizes)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=repeat)


def tier_config(tier: str, block_size: int, ssd_dir: str) -> CacheConfig:
    """A cache that holds the chain only in ``tier``: hot (hot-only, no cap) or ssd
    (hot kept empty, no promotion, the whole chain queued for the writer at once)."""
    if tier == "hot":
        return CacheConfig(block_size=block_size, hot_cache_only=True, hot_max_bytes=64 << 30)
    return CacheConfig(
        block_size=block_size,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=ssd_dir,
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )


def shaped_model(args):
    """A tiny-weight llama whose cache has the benchmark's layers, kv heads and head_dim."""
    return build_model(
        "llama",
        dtype=mx.bfloat16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.kv_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
    )


def synthetic_cache(args, num_tokens: int) -> list[KVCache]:
    """A filled bf16 KVCache per layer (random values), without running the model."""
    cache = []
    for _ in range(args.layers):
        c = KVCache()
        shape = (1, args.kv_heads, num_tokens, args.head_dim)
        k = mx.random.normal(shape).astype(mx.bfloat16)
        c.update_and_fetch(k, mx.random.normal(shape).astype(mx.bfloat16))
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def drop_caches(paths: list[str], level: int = 3) -> None:
    """Empty the kernel's caches (as root; level 1: the page cache, 3: also dentries
    and inodes), else advise the kernel to drop these files' pages."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(str(level))
        return
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (written back first), and only
    theirs: a cold read of them, with no effect on other processes' cached files."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def readahead(paths: list[str]) -> None:
    """Ask the kernel to start reading these files into the page cache (no waiting)."""
    if not hasattr(os, "posix_fadvise"):  # e.g. macOS: nothing to ask for
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # absent or gone: the read will tell
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def read_reused(paths: list[str], buf: bytearray) -> None:
    """Read each file through one reused buffer: with 1 MiB, ``dd bs=1M`` (the
    destination stays in the CPU cache: the strict reference)."""
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def read_into_fresh(path: str, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """ONE file read into ONE fresh buffer of ``nbytes`` (``readinto``): the SSD
    restore targets' reference (issue 19); or into ``out``, a buffer kept."""
    out = np.empty(nbytes, dtype=np.uint8) if out is None else out
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(out))
    return out


def read_fresh(paths: list[str]) -> None:
    """Read each file whole into fresh memory (the raw reference of a file set)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            f.read()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status("VmRSS:")


def chain_fetch(model, args, tier: str, block_size: int, ssd_dir: str = ""):
    """A cache holding a chain of the benchmark's shape (random tokens, seeded by
    ``block_size``) in ``tier`` only (``tier_config``), and a function fetching it
    whole and evaluating the cache (AssertionError if it restores less). Close the
    cache when done."""
    tokens = np.random.default_rng(block_size).integers(0, 512, args.tokens).tolist()
    probe = [*tokens, 1]
    pc = PrefixCache(model, tier_config(tier, block_size, ssd_dir))
    pc.store(tokens, synthetic_cache(args, args.tokens))
    pc.flush()  # an SSD tier's files written

    def fetch() -> None:
        cache, num = pc.fetch(probe)
        mx.eval([c.state for c in cache])
        if num != args.tokens:
            raise AssertionError(f"fetch restored {num} of {args.tokens} tokens")

    return pc, fetch


def restore_like_buffers(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """uint16 views of new buffers made as a restore makes its own (one MLX load, zeros
    under 1 MiB, huge pages asked for). Each view keeps its array alive."""
    from prefixcache.memory.huge_pages import advise_huge  # (a base checkout may lack these)
    from prefixcache.memory.restore_buffers import new_buffer

    with batched(mx.cpu):
        made = [new_buffer(shape, mx.uint16) for shape in shapes]
    arrays = [resolve(x) for x in made]
    mx.eval(arrays)
    out = []
    for a in arrays:
        host = host_view(a)
        advise_huge(host)
        out.append(host.view(np.uint16))
    return out


class Clock:
    """Wall time, this process's CPU time (all its threads) and page faults of a
    block of code."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.faults = minor_faults()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        self.faults = minor_faults() - self.faults


def minor_faults() -> int:
    """Page faults this process has taken without I/O (fresh or recycled memory
    shows here: a fresh 4 KiB page costs one, a huge page one per 2 MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def arrivals(rng: random.Random, conversations: int, turns: int, active: int) -> Iterator[tuple]:
    """(conversation, turn) in arrival order: ``active`` conversations at once, the next
    turn of a random one each time (bench_serve's and bench_serve_http's trace). Lazy:
    the caller's draws from ``rng`` between two arrivals are part of the trace."""
    pending, current, done = list(range(conversations)), [], [0] * conversations
    while pending or current:
        while len(current) < active and pending:
            current.append(pending.pop(0))
        conv = rng.choice(current)
        yield conv, done[conv]
        done[conv] += 1
        if done[conv] == turns:
            current.remove(conv)


def add_trace_args(p) -> None:
    """bench_serve's trace and model, and the rounds (also bench_serve_http's)."""
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--active", type=int, default=4, help="conversations interleaved at once")
    p.add_argument("--systems", type=int, default=3, help="distinct shared system prompts")
    p.add_argument("--max-tokens", type=int, default=8, help="generated per turn")
    p.add_argument("--block-size", type=int, default=32, help="ours")
    p.add_argument("--hidden", type=int, default=128, help="model width (4 layers, head_dim 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="replays per system, order alternated")


def chat_model_shape(hidden: int) -> dict[str, int]:
    """bench_serve's llama: 4 layers of width ``hidden``, head_dim 32."""
    return {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 64),
    }


def rows_in(root: str, script: str, argv: list[str]) -> list[dict[str, object]]:
    """Run ``script`` with ``argv`` in a child process importing the prefixcache of
    the checkout at ``root`` (before and after, back to back); its rows, which it
    prints as JSON on its last line."""
    import json
    import subprocess
    import sys

    rest = os.environ.get("PYTHONPATH")  # kept after the checkout: packages beside it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(root), rest]))}
    cmd = [sys.executable, script, "--json", *argv]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def add_csv_arg(p) -> None:
    """``--csv FILE``: the table's figures as numbers, one row per line (for tools/plots.py)."""
    p.add_argument("--csv", metavar="FILE", help="also write the table's figures here as CSV")


def write_csv(path: str | None, rows: list[dict[str, object]]) -> None:
    """Write ``rows`` (dicts with the same keys) to ``path`` as CSV; nothing when no path."""
    if not path or not rows:
        return
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:  # six significant digits: the figures are no more precise
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})


def huge_bytes_in(start: int, nbytes: int) -> int:
    """AnonHugePages (bytes) of this process's mappings overlapping [start, start + nbytes)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + nbytes and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total
