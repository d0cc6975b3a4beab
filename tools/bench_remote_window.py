"""What a remote restore of a windowed model moves and keeps: bytes the server sent,
payload bytes no layer of the restore reads, page faults and fetch time.

A real redis-server is started (and stopped) by the tool. Host one prefills a
``--tokens`` chain of a model-shaped cache (``--shape``: presets of
tools/shapes.py; the default is gpt-oss-20b's: 24 layers alternating a
128-token window and full attention, 8 KV heads x 64, bf16) with the default
restore points, through to the server; host two (an empty SSD tier, a hot tier
of one byte, nothing promoted) restores the chain from the server ``--repeat``
times. Per fetch: the server's ``total_net_output_bytes`` delta, the payload
bytes of the tensors the restore marks ``UNNEEDED`` (window layers' K/V of
blocks behind the window), the minor page faults of this process and the
wall time; then, in one more fetch, the peak of the host memory numpy and
Python allocated during it (``tracemalloc``: the reader's buffers for tensors
without a place; MLX's restore buffers are not counted). Run it with
``PYTHONPATH`` naming each checkout to compare, one after the other:

    PYTHONPATH=/path/to/checkout nice python tools/bench_remote_window.py [--tokens 4096]
        [--shape gpt-oss-20b] [--block-size 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc

import mlx.core as mx
import numpy as np
from shapes import model_for, named

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer  # the tests' server launcher

import prefixcache
from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory.host import UNNEEDED
from prefixcache.tiers.remote import reader


def count_unneeded(seen: list[int]) -> None:
    """Add to ``seen`` the bytes of every tensor the remote reader is told no layer reads."""
    prepare = reader.RemoteReader.prepare

    def counted(self, indices, place):
        if place is None:
            return prepare(self, indices, place)

        def counting(index, name, dtype, shape, count=1):
            region = place(index, name, dtype, shape, count)
            if region is UNNEEDED:
                seen.append(int(np.prod(shape)) * dtype.size * count)
            return region

        return prepare(self, indices, counting)

    reader.RemoteReader.prepare = counted


def sent_bytes(server: RedisServer) -> int:
    return int(server.client().info("stats")["total_net_output_bytes"])


def host(model, url: str, ssd_dir: str, block_size: int, **settings) -> PrefixCache:
    config = CacheConfig(
        block_size=block_size, ssd_dir=ssd_dir, ssd_min_free_bytes=0, remote_url=url, **settings
    )
    return PrefixCache(model, config, model_id="bench")


def measure(args) -> dict[str, object]:
    shape = named([args.shape])[0]
    model = model_for(shape)
    tokens = np.random.default_rng(0).integers(0, 512, args.tokens).tolist()
    seen: list[int] = []
    count_unneeded(seen)
    with tempfile.TemporaryDirectory() as root:
        server = RedisServer(root, maxmemory="4gb")
        try:
            with host(model, server.url, f"{root}/one", args.block_size) as one:
                one.prefill(tokens)
                one.flush()
            two = host(
                model, server.url, f"{root}/two", args.block_size, hot_max_bytes=1, promote=False
            )
            rounds = []
            try:
                for _ in range(args.repeat + 1):  # the first warms MLX's allocations
                    seen.clear()
                    sent, faults = sent_bytes(server), resource.getrusage(0).ru_minflt
                    start = time.perf_counter()
                    cache, num = two.fetch([*tokens, 1])
                    mx.eval([c.state for c in cache])
                    took = time.perf_counter() - start
                    faults = resource.getrusage(0).ru_minflt - faults
                    rounds.append((took, sent_bytes(server) - sent, sum(seen), faults, num))
                    del cache
                stats = two.stats()["remote"]
                tracemalloc.start()  # apart from the timed rounds: it slows allocations
                cache, _ = two.fetch([*tokens, 1])
                mx.eval([c.state for c in cache])
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                del cache
            finally:
                two.close()
        finally:
            server.stop()
    rounds = rounds[1:]
    return {
        "code": os.path.dirname(os.path.dirname(prefixcache.__file__)),
        "shape": shape.name,
        "tokens": args.tokens,
        "block": args.block_size,
        "restored": rounds[0][4],
        "fetch_ms": statistics.median(r[0] for r in rounds) * 1e3,
        "fetch_ms_range": [min(r[0] for r in rounds) * 1e3, max(r[0] for r in rounds) * 1e3],
        "sent_mib": statistics.median(r[1] for r in rounds) / 2**20,
        "unneeded_mib": statistics.median(r[2] for r in rounds) / 2**20,
        "faults": statistics.median(r[3] for r in rounds),
        "peak_host_mib": peak / 2**20,
        "load_mib": stats["load_bytes"] / (args.repeat + 1) / 2**20,  # verified payload
        "load": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    print(json.dumps(measure(p.parse_args())))


if __name__ == "__main__":
    main()
