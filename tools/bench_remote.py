"""Remote tier benchmark against a real redis-server started here (or ``--url``).

Stores a model-shaped chain (default: 32 layers, 8 kv heads, head_dim 128,
bf16: 128 KiB per token, 32 MiB per 256-token block) through one PrefixCache
("host a", remote tier only) and measures from a second one ("host b", its own
empty local tiers), interleaved and repeated (medians of per-round ratios):

  get      a plain pipelined GET of the very same part keys (every byte the
           restore needs, one pipeline) through redis-py: what a client gets
  read     the same GETs' replies read off the socket into one fresh buffer
           (no parser, no check, no restore): the transport's own bound
  fetch    PrefixCache.fetch of the whole chain on host b: lookup, fetch,
           verify every part, restore into an mlx-lm cache (GB/s of payload)
  ttft     host b's time to first token: fetch + prefill of the 1-token suffix
  prefill  the same prompt recomputed from scratch (time to first token; once)

the cost of ``store`` on the caller's thread with and without the remote tier
(blocks go remote on store) and how long until the server has every block,
and the cost an unreachable server adds to a fetch that misses the local
tiers: the server stopped (SIGSTOP: a hung server, calls time out) or killed
(connection refused), for the first request (breaker closed) and the next
ones (breaker open), against the same fetch with no remote tier.

The compute side is a random-weight model with the cache's shape, far cheaper
per token than a real 8B model: ``prefill`` here understates recomputing.

    python tools/bench_remote.py --tokens 1024 --repeat 7
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from benchlib import shaped_model, synthetic_cache
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiers.remote.format import decode_meta, meta_key, part_key
from prefixcache.tiers.remote.wire import Replies, pipelined_gets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer  # the tests' server launcher


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timeout-ms", type=int, default=200, help="remote_timeout_ms")
    p.add_argument("--unix", action="store_true", help="serve on a unix socket")
    return p


def config(args, url: str | None, **changes) -> CacheConfig:
    base = CacheConfig(
        block_size=args.block_size, hot_cache_only=True, hot_max_bytes=1, promote=False,
        remote_url=url, remote_timeout_ms=args.timeout_ms,
        remote_connect_timeout_ms=args.timeout_ms, remote_breaker_failures=1,
        remote_breaker_ms=60_000, prefill_tokens_per_s=1,
    )  # fmt: skip
    return base.replace(**changes)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def plain_get(client, names: list[str]) -> int:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return sum(len(v) for v in pipe.execute())


def socket_read(client, names: list[str]) -> int:
    """The replies of pipelined GETs of ``names`` read into one fresh buffer."""

    def body(replies: Replies) -> int:
        sizes = []
        for _ in names:
            sizes.append(replies.length())
            replies.read_into(memoryview(buf)[sum(sizes[:-1]) :][: sizes[-1]])
            replies.end()
        return sum(sizes)

    buf = np.empty(sum(client.strlen(n) for n in names), np.uint8)
    return pipelined_gets(client, names, body)


def store_cost(args, model, server: RedisServer) -> dict[str, float]:
    """ms: ``store`` of a chain on the caller's thread without and with the remote
    tier (blocks go remote on store), and how long until the server has them all."""
    out: dict[str, list[float]] = {"store, no remote tier": [], "store, remote tier": [],
                                   "until every block is on the server": []}  # fmt: skip
    for r in range(args.repeat):
        tokens = list(range(10_000 * (r + 1), 10_000 * (r + 1) + args.tokens))
        cache = synthetic_cache(args, len(tokens))
        with PrefixCache(model, config(args, None), model_id="bench") as pc:
            out["store, no remote tier"].append(timed(pc.store, tokens, cache))
        with PrefixCache(model, config(args, server.url), model_id="bench") as pc:
            out["store, remote tier"].append(timed(pc.store, tokens, cache))
            out["until every block is on the server"].append(timed(pc.flush))
        server.client().flushall()
    return {k: statistics.median(v) * 1000 for k, v in out.items()}


def transfer(args, model, server: RedisServer) -> dict[str, list[float]]:
    tokens = list(range(1, args.tokens + 1))
    with PrefixCache(model, config(args, server.url), model_id="bench") as a:
        a.store(tokens, synthetic_cache(args, len(tokens)))
        a.flush()
        keys = chain_keys(a.namespace.root_key(), token_bytes(tokens), args.block_size)
    client = server.client()
    names = []
    for key in keys:  # every part of every block: the bytes a restore fetches
        meta = decode_meta(key, client.get(meta_key("prefixcache", key)))
        names += [part_key("prefixcache", key, n) for n in range(meta.num_parts)]
    nbytes = len(tokens) * args.layers * 2 * args.kv_heads * args.head_dim * 2
    out: dict[str, list[float]] = {k: [] for k in ("get", "read", "fetch", "ratio", "bound")}
    out |= {"ttft": [], "prefill": []}
    b = PrefixCache(model, config(args, server.url), model_id="bench")
    prompt = [*tokens, 7]
    for _ in range(args.repeat):
        t_get = timed(lambda: plain_get(client, names))
        t_read = timed(lambda: socket_read(client, names))
        t_fetch = timed(lambda: b.fetch(tokens))
        out["get"].append(nbytes / t_get / 1e9)
        out["read"].append(nbytes / t_read / 1e9)
        out["fetch"].append(nbytes / t_fetch / 1e9)
        out["ratio"].append(t_get / t_fetch)
        out["bound"].append(t_read / t_fetch)
        out["ttft"].append(timed(lambda: first_token(model, b, prompt)))
        if not out["prefill"]:  # one recompute: it takes far longer than the rest
            out["prefill"].append(timed(lambda: first_token(model, None, prompt)))
    b.close()
    client.close()
    return out


def first_token(model, pc: PrefixCache | None, prompt: list[int]) -> None:
    """Restore what ``pc`` has (None: nothing), prefill the rest, take the argmax."""
    cache, start = pc.fetch(prompt) if pc is not None else (make_prompt_cache(model), 0)
    ids = mx.array(prompt, dtype=mx.int32)[None]
    for at in range(start, len(prompt), 2048):
        logits = model(ids[:, at : at + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))


def unreachable(args, model, server: RedisServer) -> dict[str, float]:
    """Fetch latency (ms) of a local miss: no remote, hung server, refused connection."""
    prompt = list(range(3, 3 + 2 * args.block_size + 1))
    out = {}
    with PrefixCache(model, config(args, None), model_id="bench") as pc:
        out["no remote tier"] = statistics.median(timed(lambda: pc.fetch(prompt)) for _ in range(5))
    for case in ("hung", "refused"):
        if case == "hung":
            os.kill(server.proc.pid, signal.SIGSTOP)
        else:
            os.kill(server.proc.pid, signal.SIGCONT)
            server.kill()
        with PrefixCache(model, config(args, server.url), model_id="bench") as pc:
            out[f"{case}: first request"] = timed(lambda: pc.fetch(prompt))
            out[f"{case}: breaker open"] = statistics.median(
                timed(lambda: pc.fetch(prompt)) for _ in range(5)
            )
            assert pc.stats()["remote"]["breaker_open"] == 1
    return {k: v * 1000 for k, v in out.items()}


def main() -> None:
    args = setup_arg_parser().parse_args()
    model = shaped_model(args)
    with tempfile.TemporaryDirectory() as work:
        server = RedisServer(work, unix=args.unix, maxmemory="4gb")
        try:
            store = store_cost(args, model, server)
            res = transfer(args, model, server)
            cost = unreachable(args, model, server)
        finally:
            if server.proc is not None:
                os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()
    mib = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2 / 2**20
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{args.tokens} tokens, {mib:.0f} MiB, {args.repeat} rounds, {server.url.split(':')[0]}")
    print("| measure | median | range |")
    print("|---|---|---|")
    rows = (("get", "get", " GB/s"), ("read", "read", " GB/s"), ("fetch", "fetch", " GB/s"),
            ("ratio", "fetch / get", ""), ("bound", "fetch / read", ""))  # fmt: skip
    for name, label, unit in rows:
        lo, hi = min(res[name]), max(res[name])
        print(f"| {label} | {med[name]:.2f}{unit} | {lo:.2f}-{hi:.2f} |")
    for name in ("ttft", "prefill"):
        lo, hi = min(res[name]) * 1000, max(res[name]) * 1000
        print(f"| {name} | {med[name] * 1000:.0f} ms | {lo:.0f}-{hi:.0f} |")
    print(f"| ttft / prefill | {med['ttft'] / med['prefill']:.2f} | |")
    print("\n| store of the chain (median) | ms |")
    print("|---|---|")
    for name, ms in store.items():
        print(f"| {name} | {ms:.1f} |")
    print(f"\nunreachable server (timeout {args.timeout_ms} ms), fetch latency of a local miss:")
    print("| case | ms |")
    print("|---|---|")
    for name, ms in cost.items():
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
