"""Remote tier benchmark against a real redis-server and a real 3-master Redis Cluster
started here, with and without ``remote_secret`` (signed, sealed blocks).

Stores a model-shaped chain (default: 32 layers, 8 kv heads, head_dim 128,
bf16: 128 KiB per token, 32 MiB per 256-token block) through one PrefixCache
("host a", remote tier only), once unsigned and once signed (two prefixes),
and measures from a second one ("host b", its own empty local tiers),
interleaved and repeated (medians of per-round ratios):

  get        plain pipelined GETs of the very same part keys (every byte the
             restore needs) through redis-py, one pipeline per shard, the
             shards one after another: what a client gets
  get ||     the same, the shards' pipelines in parallel threads (cluster)
  read       the same GETs' replies read off the socket into one fresh buffer
             (no parser, no check, no restore): the transport's own bound
  fetch      PrefixCache.fetch of the whole chain on host b: lookup, fetch,
             verify every part, restore into an mlx-lm cache (GB/s of payload)
  fetch, signed   the same with remote_secret: every part's HMAC-SHA256 is
             checked in a staging buffer before its bytes reach the cache
  hmac, xxh3 the digests alone over the same bytes in memory (one core)
  ttft       host b's time to first token: fetch + prefill of the 1-token suffix
  prefill    the same prompt recomputed from scratch (time to first token; once)

then (single server) the cost of ``store`` on the caller's thread with and
without the remote tier and how long until the server has every block, and
the cost an unreachable server adds to a fetch that misses the local tiers:
the server stopped (SIGSTOP: calls time out) or killed (connection refused),
for the first request (breaker closed) and the next ones (breaker open).

The compute side is a random-weight model with the cache's shape, far cheaper
per token than a real 8B model: ``prefill`` here understates recomputing.

    python tools/bench_remote.py --tokens 1024 --repeat 7 [--mx-cache-limit 4G]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import xxhash
from bench_remote_faults import store_cost, unreachable
from benchlib import shaped_model, synthetic_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.config import parse_bytes
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiers.remote.client import RemoteClient
from prefixcache.tiers.remote.format import PART_BYTES, PART_HEAD_BYTES, decode_head
from prefixcache.tiers.remote.wire import Replies, pipelined_gets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_cluster import RedisCluster  # the tests' server launchers
from redis_server import RedisServer

SECRET = "benchmark secret, 32 characters!"
ROWS = (
    ("get", "plain pipelined GET of the same part keys (redis-py, hiredis)", " GB/s"),
    ("get ||", "the same, the shards' pipelines in parallel", " GB/s"),
    ("read", "the same GETs' replies read off the socket into one buffer", " GB/s"),
    ("fetch", "`fetch` from the remote tier (lookup, fetch, verify, restore)", " GB/s"),
    ("fetch, signed", "`fetch` with `remote_secret` (HMAC checked before the copy)", " GB/s"),
    ("fetch / get", "fetch / GET (per round)", ""),
    ("signed / get", "signed fetch / GET (per round)", ""),
    ("fetch / get ||", "fetch / parallel GET (per round)", ""),
    ("hmac", "HMAC-SHA256 of the same bytes in memory (one core)", " GB/s"),
    ("xxh3", "xxh3-128 of the same bytes in memory (one core)", " GB/s"),
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timeout-ms", type=int, default=200, help="remote_timeout_ms")
    p.add_argument("--topology", choices=("single", "cluster", "both"), default="both")
    p.add_argument("--unix", action="store_true", help="the single server on a unix socket")
    p.add_argument(
        "--mx-cache-limit", type=parse_bytes, help="MLX's buffer cache (serve's flag), e.g. 4G"
    )
    return p


def config(args, url: str | None, **changes) -> CacheConfig:
    base = CacheConfig(
        block_size=args.block_size,
        hot_cache_only=True,
        hot_max_bytes=1,
        promote=False,
        remote_url=url,
        remote_timeout_ms=max(args.timeout_ms, 2000),
        remote_connect_timeout_ms=args.timeout_ms,
        remote_breaker_failures=1,
        remote_breaker_ms=60_000,
        prefill_tokens_per_s=1,
    )
    return base.replace(**changes)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def by_shard(rc: RemoteClient, names: list[str]) -> list[tuple[object, list[str]]]:
    groups: dict = {}
    for name in names:
        groups.setdefault(rc.shard_of(name), []).append(name)
    return list(groups.items())


def plain_get(rc: RemoteClient, groups, parallel: bool = False) -> int:
    def run(client, names) -> int:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return sum(len(v) for v in pipe.execute())

    jobs = [(shard, lambda r, names=names: run(r, names)) for shard, names in groups]
    if parallel:
        return sum(rc.each(jobs))
    return sum(rc.call(shard, fn) for shard, fn in jobs)


def socket_read(rc: RemoteClient, groups, sizes: dict[str, int]) -> int:
    """The replies of pipelined GETs of every part, read into one fresh buffer."""
    buf = np.empty(sum(sizes.values()), np.uint8)
    view, at = memoryview(buf), 0

    def body(names: list[str]):
        def read(replies: Replies) -> int:
            nonlocal at
            for _ in names:
                size = replies.length()
                replies.read_into(view[at : at + size])
                replies.end()
                at += size
            return at

        return read

    for shard, names in groups:
        rc.call(shard, lambda r, names=names: pipelined_gets(r, names, body(names)))
    return at


def part_names(rc: RemoteClient, pc: PrefixCache, tokens: list[int], block_size: int):
    """The server's part key names of ``tokens``' chain, with their sizes."""
    remote = pc.tiers.named("remote")
    sizes = {}
    for key in chain_keys(pc.namespace.root_key(), token_bytes(tokens), block_size):
        meta = remote.names.meta(key)
        head = decode_head(rc.call(rc.shard_of(meta), lambda r, meta=meta: r.get(meta)))
        for n in range(head.num_parts):
            data = min(PART_BYTES, head.nbytes - n * PART_BYTES)
            sizes[remote.names.part(key, n)] = PART_HEAD_BYTES + data  # the value's length
    return sizes


def transfer(args, model, url: str) -> dict[str, list[float]]:
    tokens = list(range(1, args.tokens + 1))
    cache = synthetic_cache(args, len(tokens))
    rc = RemoteClient(config(args, url))
    for prefix, secret in (("plain", None), ("signed", SECRET)):
        cfg = config(args, url, remote_prefix=prefix, remote_secret=secret)
        with PrefixCache(model, cfg, model_id="bench") as a:
            a.store(tokens, cache)
            a.flush()
            if secret is None:
                sizes = part_names(rc, a, tokens, args.block_size)
    groups = by_shard(rc, list(sizes))
    nbytes = len(tokens) * args.layers * 2 * args.kv_heads * args.head_dim * 2
    data = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()
    b = PrefixCache(model, config(args, url, remote_prefix="plain"), model_id="bench")
    s = PrefixCache(
        model, config(args, url, remote_prefix="signed", remote_secret=SECRET), model_id="bench"
    )
    out: dict[str, list[float]] = {name: [] for name, _, _ in ROWS}
    out |= {"ttft": [], "prefill": []}
    for _ in range(args.repeat):
        t = {
            "get": timed(plain_get, rc, groups),
            "get ||": timed(plain_get, rc, groups, True),
            "read": timed(socket_read, rc, groups, sizes),
            "fetch": timed(b.fetch, tokens),
            "fetch, signed": timed(s.fetch, tokens),
        }
        for name, seconds in t.items():
            out[name].append(nbytes / seconds / 1e9)
        out["fetch / get"].append(t["get"] / t["fetch"])
        out["signed / get"].append(t["get"] / t["fetch, signed"])
        out["fetch / get ||"].append(t["get ||"] / t["fetch"])
        key = os.urandom(32)
        out["hmac"].append(len(data) / timed(hmac.digest, key, data, hashlib.sha256) / 1e9)
        out["xxh3"].append(len(data) / timed(xxhash.xxh3_128_digest, data) / 1e9)
        out["ttft"].append(timed(first_token, model, b, [*tokens, 7]))
        if not out["prefill"]:  # one recompute: it takes far longer than the rest
            out["prefill"].append(timed(first_token, model, None, [*tokens, 7]))
    blocks = args.repeat * (args.tokens // args.block_size)
    signed = s.stats()["remote"]
    assert signed["num_loads"] == blocks and signed["num_forged"] == 0, signed
    for pc in (b, s):
        pc.close()
    rc.close()
    return out


def first_token(model, pc: PrefixCache | None, prompt: list[int]) -> None:
    """Restore what ``pc`` has (None: nothing), prefill the rest, take the argmax."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, start = pc.fetch(prompt) if pc is not None else (make_prompt_cache(model), 0)
    ids = mx.array(prompt, dtype=mx.int32)[None]
    for at in range(start, len(prompt), 2048):
        logits = model(ids[:, at : at + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))


def print_transfer(args, name: str, res: dict[str, list[float]]) -> None:
    mib = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2 / 2**20
    print(f"\n{name}: {args.tokens} tokens, {mib:.0f} MiB, {args.repeat} rounds")
    print("| measure | median | range |")
    print("|---|---|---|")
    for key, label, unit in ROWS:
        if key in ("get ||", "fetch / get ||") and name == "single server":
            continue
        med, lo, hi = statistics.median(res[key]), min(res[key]), max(res[key])
        print(f"| {label} | {med:.2f}{unit} | {lo:.2f}-{hi:.2f} |")
    for key in ("ttft", "prefill"):
        med, lo, hi = (f(res[key]) * 1000 for f in (statistics.median, min, max))
        print(f"| {key} | {med:.0f} ms | {lo:.0f}-{hi:.0f} |")
    fetch, signed = (statistics.median(res[k]) for k in ("fetch", "fetch, signed"))
    mac = 1 / (1 / signed - 1 / fetch) if signed < fetch else float("inf")
    print(f"| signing's cost: 1 / (1/signed - 1/unsigned fetch) | {mac:.2f} GB/s | |")


def main() -> None:
    args = setup_arg_parser().parse_args()
    if args.mx_cache_limit is not None:  # restores reuse freed buffers, as `serve` may
        import mlx.core as mx

        mx.set_cache_limit(args.mx_cache_limit)
    model = shaped_model(args)
    with tempfile.TemporaryDirectory() as work:
        if args.topology in ("cluster", "both"):
            cluster = RedisCluster(os.path.join(work, "cluster"), maxmemory="4gb")
            try:
                print_transfer(args, "3-master cluster", transfer(args, model, cluster.url))
            finally:
                cluster.stop()
        if args.topology in ("single", "both"):
            server = RedisServer(work, unix=args.unix, maxmemory="4gb")
            try:
                print_transfer(args, "single server", transfer(args, model, server.url))
                server.client().flushall()
                store = store_cost(args, model, server, config)
                cost = unreachable(args, model, server, config)
            finally:
                if server.proc is not None:
                    os.kill(server.proc.pid, signal.SIGCONT)
                server.stop()
            print("\n| store of the chain (median) | ms |\n|---|---|")
            for name, ms in store.items():
                print(f"| {name} | {ms:.1f} |")
            print(f"\nunreachable server (timeout {args.timeout_ms} ms), fetch of a local miss:")
            print("| case | ms |\n|---|---|")
            for name, ms in cost.items():
                print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
