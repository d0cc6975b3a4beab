"""Counters of one cache, and the deltas and sums that persist them (their Prometheus
exposition: ``prometheus.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import MissReason

TIER_NAMES = ("hot", "ssd", "remote")


@dataclass(slots=True)
class Stats:
    """Counters of one PrefixCache: every counting rule is a method here.

    Tier gauges are added by the tiers' own ``stats()``.
    """

    num_fetches: int = 0
    num_hits: int = 0
    num_misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_stores: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    num_spills: int = 0
    num_promotions: int = 0
    upgraded_blocks: int = 0
    num_discarded: int = 0
    prefetched_blocks: int = 0
    prefetch_hits: int = 0
    prefetch_wasted_bytes: int = 0
    ssd_writes_deferred: int = 0
    ssd_writes_skipped: int = 0
    block_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    miss_reasons: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in MissReason})

    def fetched(self, num_tokens: int, num_cached: int, reason: MissReason | None) -> None:
        """One fetch of ``num_tokens`` that restored ``num_cached`` (``reason``: why not more)."""
        self.num_fetches += 1
        self.prompt_tokens += num_tokens
        self.cached_tokens += num_cached
        if num_cached:
            self.num_hits += 1
        else:
            self.num_misses += 1
        if reason is not None:
            self.miss_reasons[reason.value] += 1

    def block_hit(self, tier: str, count: int = 1) -> None:
        self.block_hits[tier] = self.block_hits.get(tier, 0) + count

    def kept(self, nbytes: int, *, upgrade: bool) -> None:
        """A block placed in the tiers: new, or a fuller version of a stored one."""
        if upgrade:
            self.upgraded_blocks += 1
        else:
            self.stored_blocks += 1
            self.stored_bytes += nbytes

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        hits = out.pop("block_hits")
        out.update({f"{tier}_block_hits": n for tier, n in hits.items()})
        out["miss_reasons"] = dict(self.miss_reasons)
        return out


Counters = dict[str, object]  # int counters and one nested dict[str, int] ("miss_reasons")


def ram_stats(tiers: Mapping[str, Mapping[str, int]], loading: int) -> dict[str, int]:
    """``stats()["ram"]`` from the tiers' stats: hot's bytes, every writer queue's
    bytes, a block being loaded, and the bound of all of them (stats_types.RamStats)."""
    hot = tiers["hot"]
    queues = [t for name, t in tiers.items() if name != "hot" and "queue_bytes" in t]
    queued = sum(t["queue_bytes"] for t in queues)
    return {
        "hot_bytes": hot["nbytes"],
        "queued_bytes": queued,
        "loading_bytes": loading,
        "nbytes": hot["nbytes"] + queued + loading,
        "max_bytes": hot["max_bytes"] + sum(t["queue_max_bytes"] for t in queues),
    }


def counter_delta(now: Counters, before: Counters) -> Counters:
    """``now - before`` for every int (also nested one level); others dropped."""
    out: Counters = {}
    for name, value in now.items():
        old = before.get(name)
        if isinstance(value, dict):
            old = old if isinstance(old, dict) else {}
            sub = {k: v - old.get(k, 0) for k, v in value.items() if isinstance(v, int)}
            out[name] = {k: v for k, v in sub.items() if v}
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = value - (old if isinstance(old, int) else 0)
    return out


def add_counters(total: Counters, delta: Counters) -> Counters:
    """``total + delta`` (nested one level), as a new dict."""
    out = dict(total)
    for name, value in delta.items():
        if isinstance(value, dict):
            sub = dict(out.get(name) or {})  # type: ignore[call-overload]
            for k, v in value.items():
                sub[k] = sub.get(k, 0) + v
            out[name] = sub
        elif isinstance(value, int):
            old = out.get(name, 0)
            out[name] = (old if isinstance(old, int) else 0) + value
    return out
