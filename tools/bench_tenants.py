"""Fair shares per tenant: tenant A floods a tier while B and C chat on their system prompts.

One trace through a PrefixCache (real ``fetch`` / ``store`` of real mlx-lm caches
of a tiny llama, the uncached tokens prefilled on the model), hot-only (``--tier
hot``) or a tiny hot tier over a bounded SSD tier in a temporary directory
(``--tier ssd``: the SSD tier's shares, B's and C's hits from the SSD): A replays
one-off prompts adding up to ``--flood`` times the tier's budget over ``--rounds``
rounds; each ends with one request of B and one of C, each its own system prompt
plus a new user message; B and C alone (no A) are the reference. Systems:

  alone     B and C only, no tenant shares
  no shares A, B and C, no tenant shares (today's default)
  floors    A, B and C, floors B=C=``--floor`` (hot_/ssd_tenant_floors)
  A capped  A, B and C, A capped at ``--cap`` (hot_/ssd_tenant_caps), no floors

"hit %" per tenant: prompt tokens its fetches restored over its prompt tokens (a
fetch always leaves one token to prefill). "A held %": A's share of the tier's bytes
at the end. The accounting columns sum the tier's per-tenant counters of
``stats()["tenants"]``: stored, evicted (of which for A's own cap) and refused
blocks; "lost" is, on hot, every block placed (``stored_blocks`` +
``upgraded_blocks``) minus those the tenants counted (stored + refused) minus those
the stack dropped before hot (a parent gone: ``num_discarded`` minus hot's
evictions); on the SSD, the blocks its writer indexed or refused (``num_writes``,
``num_no_room``) minus those the tenants counted, plus writes dropped otherwise (a
full queue, a disk failure); and per tenant stored - held - evicted - removed: all
0 when no block leaves uncounted. Hit shares and counts are exact (no timing).

``--overhead``: the cost of the accounting instead. The hot tier alone takes chains
of 4 payload-light blocks from three tenants (``--puts`` blocks, a budget of 256
blocks, so nearly every put evicts), with no shares and with floors; then the B and
C trace through the library with no shares and with accounting only (floors of 0).
Each pair alternates ``--repeats`` times; the medians of the process's CPU seconds
and their ratio are printed (CPU time: other processes on the machine stretch the
wall clock, less the CPU time; compare only within one run).

    python tools/bench_tenants.py
    python tools/bench_tenants.py --rounds 16 --flood 10 --eviction lru
    python tools/bench_tenants.py --tier ssd
    python tools/bench_tenants.py --overhead
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.config import EVICTIONS, parse_bytes
from prefixcache.tiers.hot.tenants import TenantShares
from prefixcache.tiers.hot.tier import HotTier
from prefixcache.tiny.models import build_model

VOCAB = 512


@dataclass(frozen=True, slots=True)
class Request:
    tenant: str
    tokens: list[int]


@dataclass(slots=True)
class Share:
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def percent(self) -> float:
        return 100.0 * self.cached_tokens / max(1, self.prompt_tokens)


@dataclass(slots=True)
class Result:
    system: str
    shares: dict[str, Share] = field(default_factory=dict)
    a_held: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


def make_trace(args: argparse.Namespace, block_bytes: int) -> list[Request]:
    """A's one-off prompts, ``--flood`` x the budget in all, then B's and C's turn, per round."""
    rng = random.Random(args.seed)
    words = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    systems = {t: words(args.system_tokens) for t in "bc"}
    a_bytes = args.a_tokens // args.block_size * block_bytes
    num_a = -(-args.flood * budget(args) // a_bytes)
    trace: list[Request] = []
    for r in range(args.rounds):
        share = num_a * (r + 1) // args.rounds - num_a * r // args.rounds
        trace += [Request("a", words(args.a_tokens)) for _ in range(share)]
        trace += [Request(t, [*systems[t], *words(args.user_tokens)]) for t in "bc"]
    return trace


def budget(args: argparse.Namespace) -> int:  # of the tier the shares are on (--tier)
    return args.ssd if args.tier == "ssd" else args.hot


def run(model, trace: list[Request], config: CacheConfig, system: str, tier: str = "hot") -> Result:
    """Replay ``trace`` (fetch, prefill the rest, store, flush) through one cache
    (with ``tier="ssd"``, its SSD tier in a temporary directory); ``tier``: the
    tier whose shares are reported."""
    result = Result(system)
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as path:
        config = config.replace(ssd_dir=path) if tier == "ssd" else config
        with PrefixCache(model, config, model_id="tiny") as pc:
            for req in trace:
                cache, cached = pc.fetch(req.tokens)
                ids = mx.array([req.tokens[cached:]])
                mx.eval([c.state for c in cache], model(ids, cache=cache))
                pc.store(req.tokens, cache, tenant=req.tenant)
                share = result.shares.setdefault(req.tenant, Share())
                share.prompt_tokens += len(req.tokens)
                share.cached_tokens += cached
                pc.flush()  # its SSD writes land before the next request's (hot-only: none)
            stats = pc.stats()
    tenants = stats.get("tenants", {})
    held_by = stats[tier]["nbytes"] if tier == "ssd" else config.hot_max_bytes
    if "a" in tenants:
        result.a_held = 100.0 * tenants["a"][tier]["nbytes"] / max(1, held_by)
    if tenants:
        result.counts = accounting(stats, tier)
    return result


def accounting(stats, tier: str = "hot") -> dict[str, int]:
    """Blocks stored, evicted, refused by the tenants' counters, and those lost uncounted."""
    figures = [t[tier] for t in stats["tenants"].values()]
    total = {k: sum(f[k] for f in figures) for k in figures[0]}
    unmatched = sum(
        f["num_stored"] - f["num_blocks"] - f["num_evicted"] - f["num_removed"] for f in figures
    )
    if tier == "ssd":
        ssd = stats["ssd"]
        dropped = ssd["num_dropped_writes"] - ssd["num_no_room"]  # neither indexed nor refused
        lost = abs(ssd["num_writes"] - total["num_stored"])
        lost += abs(ssd["num_no_room"] - total["num_refused"]) + dropped
        return total | {"lost": lost, "unmatched": unmatched}
    before_hot = stats["num_discarded"] - stats["hot"]["num_evictions"]
    placed = stats["stored_blocks"] + stats["upgraded_blocks"]
    lost = placed - total["num_stored"] - total["num_refused"] - before_hot
    return total | {"lost": lost, "unmatched": unmatched}


def row(res: Result) -> dict[str, str]:
    pct = lambda t: f"{res.shares[t].percent:.1f}" if t in res.shares else "-"  # noqa: E731
    c = res.counts
    count = lambda k: str(c[k]) if c else "-"  # noqa: E731
    return {
        "system": res.system,
        "B hit %": pct("b"),
        "C hit %": pct("c"),
        "A hit %": pct("a"),
        "A held %": f"{res.a_held:.0f}" if c else "-",
        "stored": count("num_stored"),
        "evicted": count("num_evicted"),
        "A cap evictions": count("num_cap_evictions"),
        "refused": count("num_refused"),
        "lost": f"{c['lost'] + c.get('unmatched', 0)}" if c else "-",
    }


def put_seconds(stores: list[tuple[str, list[Block]]], shares: TenantShares | None) -> float:
    """Seconds to put every chain into a fresh 256-block hot tier (evicting as it goes)."""
    hot = HotTier(256 * stores[0][1][0].nbytes, tenants=shares, policy="lru")
    began = time.process_time()
    for tenant, chain in stores:
        if shares is not None:
            with shares.charging(tenant):
                for block in chain:
                    hot.put(block)
        else:
            for block in chain:
                hot.put(block)
        hot.touch([b.key for b in chain])
    return time.process_time() - began


def overhead(args: argparse.Namespace, model, trace: list[Request], base: dict) -> None:
    """Per put and per request, without and with the tenant accounting, alternated."""
    rng = random.Random(args.seed)
    data = {"0.keys": mx.zeros((16,), mx.float32)}
    stores = []
    for i in range(args.puts // 4):
        keys = [rng.randbytes(16) for _ in range(4)]
        parents = [b"r" * 16, *keys[:-1]]
        chain = [
            Block.make(k, p, b"r" * 16, j, b"", data)
            for j, (k, p) in enumerate(zip(keys, parents, strict=True))
        ]
        stores.append(("abc"[i % 3], chain))
    alone = [r for r in trace if r.tenant != "a"]
    timed: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        timed.setdefault("put, no shares", []).append(put_seconds(stores, None))
        shares = TenantShares({"b": 64 * 64, "c": 64 * 64}, {})
        timed.setdefault("put, floors", []).append(put_seconds(stores, shares))
        for name, extra in (
            ("request, no shares", {}),
            ("request, accounting", {"hot_tenant_floors": "b=0,c=0"}),
        ):
            began = time.process_time()
            run(model, alone, CacheConfig(**(base | extra)), name)
            timed.setdefault(name, []).append(time.process_time() - began)
    per = {"put": 1e9 / len(stores) / 4, "request": 1e3 / len(alone)}
    unit = {"put": "ns per put", "request": "ms per request"}
    for kind in ("put", "request"):
        off, on = (statistics.median(v) for k, v in timed.items() if k.startswith(kind))
        print(
            f"{kind}: {off * per[kind]:.1f} -> {on * per[kind]:.1f} {unit[kind]} "
            f"(median of {args.repeats}), ratio {on / off:.3f}"
        )


def add_traffic_args(p: argparse.ArgumentParser) -> None:  # the tenants' traffic, shares
    p.add_argument("--flood", type=int, default=10, help="A's bytes, times the tier's budget")
    p.add_argument("--rounds", type=int, default=8, help="B's and C's requests each")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=64)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--a-tokens", type=int, default=96, help="tokens of each of A's prompts")
    p.add_argument("--floor", type=parse_bytes, help="B's and C's floor (default: budget / 4)")
    p.add_argument("--cap", type=parse_bytes, help="A's cap (default: budget / 4)")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", choices=("hot", "ssd"), default="hot", help="the shares' tier")
    p.add_argument("--hot", type=parse_bytes, help="hot budget (256K; --tier ssd: 32K)")
    p.add_argument("--ssd", type=parse_bytes, default=parse_bytes("512K"), help="SSD budget")
    add_traffic_args(p)
    p.add_argument("--eviction", choices=EVICTIONS, help="hot eviction (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    p.add_argument("--overhead", action="store_true", help="time the accounting instead")
    p.add_argument("--puts", type=int, default=40_000, help="--overhead: blocks put")
    p.add_argument("--repeats", type=int, default=5, help="--overhead: runs of each")
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    if args.hot is None:
        args.hot = parse_bytes("32K" if args.tier == "ssd" else "256K")
    model = build_model("llama", seed=args.seed)
    probe = make_prompt_cache(model)
    model(mx.array([[1] * args.block_size]), cache=probe)
    block_bytes = sum(c.keys[..., : args.block_size, :].nbytes * 2 for c in probe)
    floor = args.floor or budget(args) // 4
    cap = args.cap or budget(args) // 4
    base = {"block_size": args.block_size, "hot_cache_only": True, "hot_max_bytes": args.hot}
    if args.tier == "ssd":  # every block spilled is admitted: the shares decide what stays
        base |= {"hot_cache_only": False, "ssd_max_bytes": args.ssd, "ssd_min_free_bytes": 0}
        base |= {"ssd_admit_after": 1, "queue_full": "inline"}
    if args.eviction:
        base["eviction"] = args.eviction
    trace = make_trace(args, block_bytes)
    if args.overhead:
        overhead(args, model, trace, base)
        return
    num_a = sum(r.tenant == "a" for r in trace)
    a_bytes = num_a * (args.a_tokens // args.block_size) * block_bytes
    ssd = f"ssd {args.ssd >> 10} KiB, " if args.tier == "ssd" else ""
    print(
        f"hot {args.hot >> 10} KiB ({args.hot // block_bytes} blocks of {block_bytes} B), {ssd}"
        f"A: {num_a} one-off prompts of {args.a_tokens} tokens "
        f"({a_bytes / budget(args):.1f}x {args.tier}), "
        f"B, C: {args.rounds} requests each ({args.system_tokens}-token system prompt + "
        f"{args.user_tokens}), {args.tier} floors {floor >> 10} KiB, A's cap {cap >> 10} KiB"
    )
    t = args.tier
    systems = [
        ("alone", [r for r in trace if r.tenant != "a"], {}),
        ("no shares", trace, {}),
        ("floors", trace, {f"{t}_tenant_floors": f"b={floor},c={floor}"}),
        ("A capped", trace, {f"{t}_tenant_caps": f"a={cap}"}),
    ]
    rows = []
    for name, requests, shares in systems:
        rows.append(row(run(model, requests, CacheConfig(**(base | shares)), name, t)))
        print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    print()
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    for line in [dict(zip(widths, widths, strict=True)), *rows]:
        print("  ".join(line[k].ljust(w) for k, w in widths.items()))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
