"""Tenant shares on the remote tier, against a real redis-server started here.

Fairness (default): tools/bench_tenants.py's trace (tenant A replays one-off
prompts adding up to ``--flood`` times the remote budget, spread over
``--rounds`` rounds; each round ends with one request of B and one of C,
each its own system prompt plus a new user message) through a PrefixCache
whose only lower tier is the remote one (``hot_cache_only`` with
``remote_url``), behind a hot tier too small to keep B's and C's prompts
between their turns: their hits come from the server. Systems:

  alone     B and C only, no tenant shares, no ``maxmemory``
  no shares A, B and C, the server's own LRU (today's default):
            ``allkeys-lru`` with ``maxmemory`` = its memory in use when empty +
            the most memory the two systems below ended with (printed): the
            same memory, the server's overheads included
  floors    A, B and C, ``noeviction``, remote_max_bytes ``--remote``,
            remote_tenant_floors B=C=``--floor``
  A capped  as floors, with remote_tenant_caps A=``--cap`` and no floors

"hit %": prompt tokens restored over prompt tokens, per tenant; "A held %":
A's share of the bytes the tenants hold on the server; the counts are the
tenants' (``stats()["tenants"][name]["remote"]``, every host's); "lost":
per tenant stored - held - evicted - removed, summed, plus the writes
dropped (0: no block leaves uncounted). Exact figures (no timing).

``--overhead``: the write and fetch path, shares off and on, in one run:
``--chains`` chains of ``--blocks`` blocks (``--scale`` x 3 KiB each) put
through a RemoteTier, flushed after each chain (writes/s), then the last
three chains fetched whole, four times each (lookup + every block's parts;
ms per chain). Systems: off (no shares,
``allkeys-lru``), on (a cap no write reaches: the reservation only), on,
evicting (a budget of a quarter of what is written: most writes evict).
Alternated ``--repeats`` times (the order reversed every other round),
medians and their ratios to off. Wall time
on a shared machine: compare only within one run.

    python tools/bench_remote_shares.py
    python tools/bench_remote_shares.py --overhead
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import mlx.core as mx
from bench_tenants import Result, Share, add_traffic_args, make_trace, row
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.config import parse_bytes
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiny.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from redis_server import RedisServer
from ssd_child import make_block


def fresh(server: RedisServer, policy: str, maxmemory: int = 0) -> int:
    """Empty the server and set its eviction (``maxmemory``: bytes above its memory in
    use when empty; 0: none); its memory in use when empty."""
    r = server.client()
    r.flushall()
    r.config_set("maxmemory", 0)
    r.config_set("maxmemory-policy", policy)
    empty = int(r.info("memory")["used_memory"])
    if maxmemory:
        r.config_set("maxmemory", empty + maxmemory)
    r.close()
    return empty


def used(server: RedisServer) -> int:
    r = server.client()
    try:
        return int(r.info("memory")["used_memory"])
    finally:
        r.close()


def run(model, trace, config: CacheConfig, system: str) -> Result:
    """Replay ``trace`` (fetch, prefill the rest, store, flush) through one cache."""
    result = Result(system)
    with PrefixCache(model, config, model_id="tiny") as pc:
        for req in trace:
            cache, cached = pc.fetch(req.tokens)
            mx.eval([c.state for c in cache], model(mx.array([req.tokens[cached:]]), cache=cache))
            pc.store(req.tokens, cache, tenant=req.tenant)
            share = result.shares.setdefault(req.tenant, Share())
            share.prompt_tokens += len(req.tokens)
            share.cached_tokens += cached
            pc.flush()  # its remote writes land before the next request
        stats = pc.stats()
    tenants = {n: t["remote"] for n, t in stats.get("tenants", {}).items()}
    if tenants:
        held = sum(f["nbytes"] for f in tenants.values())
        result.a_held = 100.0 * tenants.get("a", {"nbytes": 0})["nbytes"] / max(1, held)
        total = {k: sum(f[k] for f in tenants.values()) for k in next(iter(tenants.values()))}
        lost = sum(
            f["num_stored"] - f["num_blocks"] - f["num_evicted"] - f["num_removed"]
            for f in tenants.values()
        )
        result.counts = total | {"lost": lost + stats["remote"]["num_dropped_writes"]}
    return result


def fairness(args: argparse.Namespace, server: RedisServer) -> list[dict[str, str]]:
    """Print and return the fairness table's rows."""
    model = build_model("llama", seed=args.seed)
    probe = make_prompt_cache(model)
    model(mx.array([[1] * args.block_size]), cache=probe)
    block_bytes = sum(c.keys[..., : args.block_size, :].nbytes * 2 for c in probe)
    trace_args = replace_ns(args, tier="hot", hot=args.remote)  # the trace's budget: remote's
    trace = make_trace(trace_args, block_bytes)
    floor, cap = args.floor or args.remote // 4, args.cap or args.remote // 4
    base = {"block_size": args.block_size, "hot_cache_only": True, "hot_max_bytes": args.hot}
    base |= {"remote_url": server.url}
    shared = {"remote_max_bytes": args.remote}
    num_a = sum(r.tenant == "a" for r in trace)
    print(
        f"hot {args.hot >> 10} KiB, remote {args.remote >> 10} KiB ({block_bytes} B blocks "
        f"as held, before their metas), A: {num_a} one-off prompts of {args.a_tokens} tokens; "
        f"B, C: {args.rounds} requests each; floors {floor >> 10} KiB, A's cap {cap >> 10} KiB"
    )
    systems = [  # the shares first: "no shares" gets the memory they ended with
        ("floors", trace, "noeviction", shared | {"remote_tenant_floors": f"b={floor},c={floor}"}),
        ("A capped", trace, "noeviction", shared | {"remote_tenant_caps": f"a={cap}"}),
        ("alone", [r for r in trace if r.tenant != "a"], "allkeys-lru", {}),
        ("no shares", trace, "allkeys-lru", {}),
    ]
    rows, memory = [], 0
    for name, requests, policy, shares in systems:
        empty = fresh(server, policy, memory if name == "no shares" else 0)
        res = run(model, requests, CacheConfig(**(base | shares)), name)
        memory = max(memory, used(server) - empty)
        rows.append(row(res))
        print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    print(f"\nthe server's memory over empty, the most the shares' runs ended with: {memory} B")
    rows = rows[2:] + rows[:2]
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    for line in [dict(zip(widths, widths, strict=True)), *rows]:
        print("  ".join(line[k].ljust(w) for k, w in widths.items()))
    return rows


def replace_ns(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


def write_and_fetch(server: RedisServer, config: CacheConfig, chains) -> tuple[float, float]:
    """(blocks written per second, ms per chain fetched) through a fresh RemoteTier."""
    tier = RemoteTier(config)
    try:
        began = time.perf_counter()
        for chain in chains:  # one batch a chain, as a store's flush makes
            for block in chain:
                tier.put(block)
            tier.flush()
        rate = sum(map(len, chains)) / (time.perf_counter() - began)
        keep = chains[-3:]  # the newest of each tenant: still held when evicting
        began = time.perf_counter()
        for chain in keep * 4:
            keys = [b.key for b in chain]
            metas = tier.held(keys, 0)
            reader = tier.reader(keys)
            order = list(range(len(metas)))
            reader.prepare(order, None)
            got = [reader.load(i) for i in order]
            reader.close()
            assert len(got) == len(chain) and all(g is not None for g in got), "not all held"
        ms = 1e3 * (time.perf_counter() - began) / len(keep) / 4
        return rate, ms
    finally:
        tier.close()


def overhead(args: argparse.Namespace, server: RedisServer) -> None:
    chains = []
    for c in range(args.chains):
        chain = []
        for i in range(args.blocks):
            parent = chain[-1].key if chain else None
            block = make_block(1000 + c, i, scale=args.scale, parent=parent)
            chain.append(replace(block, tenant="abc"[c % 3]))
        chains.append(chain)
    one = chains[0][0].nbytes
    written = one * args.chains * args.blocks
    base = CacheConfig(remote_url=server.url, prefill_tokens_per_s=1)  # the gate admits all
    systems = [
        ("off", "allkeys-lru", base),
        ("on", "noeviction", base.replace(remote_tenant_caps=f"a={written * 2}")),
        (
            "on, evicting",
            "noeviction",
            base.replace(remote_max_bytes=written // 4, remote_tenant_floors=f"b={written // 16}"),
        ),
    ]
    print(
        f"{args.chains} chains of {args.blocks} blocks of {one >> 10} KiB "
        f"({written >> 20} MiB), tenants a, b, c; {args.repeats} rounds"
    )
    timed: dict[str, list[tuple[float, float]]] = {}
    for n in range(args.repeats):
        for name, policy, config in systems[:: 1 if n % 2 else -1]:  # each first in turn
            fresh(server, policy)
            timed.setdefault(name, []).append(write_and_fetch(server, config, chains))
    off_rate = statistics.median(r for r, _ in timed["off"])
    off_ms = statistics.median(m for _, m in timed["off"])
    for name, results in timed.items():
        rate = statistics.median(r for r, _ in results)
        ms = statistics.median(m for _, m in results)
        print(
            f"{name:13s} {rate:8.0f} writes/s ({rate / off_rate:.2f}x off)  "
            f"fetch {ms:7.2f} ms per chain ({ms / off_ms:.2f}x off)"
        )


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hot", type=parse_bytes, default=parse_bytes("32K"), help="hot budget")
    p.add_argument("--remote", type=parse_bytes, default=parse_bytes("512K"), help="remote budget")
    add_traffic_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead", action="store_true", help="time the write and fetch path")
    p.add_argument("--chains", type=int, default=24, help="--overhead: chains written")
    p.add_argument("--blocks", type=int, default=16, help="--overhead: blocks per chain")
    p.add_argument("--scale", type=int, default=32, help="--overhead: block size / 3 KiB")
    p.add_argument("--repeats", type=int, default=7, help="--overhead: rounds of each")
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-remote-shares-") as work:
        server = RedisServer(work, maxmemory="0")
        try:
            (overhead if args.overhead else fairness)(args, server)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
