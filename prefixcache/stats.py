"""Counters, the miss-reason taxonomy and the Prometheus text exposition."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum


class MissReason(str, Enum):
    """Why a fetch did not reuse every full block of the prompt."""

    NO_PREFIX = "no_prefix"  # the next block was never stored
    PARTIAL_BLOCK = "partial_block"  # the prompt's tail is shorter than a block
    EVICTED = "evicted"  # the next block was stored, then evicted from every tier
    PENDING_WRITE = "pending_write"  # the next block was dropped from the write queue
    BOUNDARY_MISSING = "boundary_state_missing"  # no recurrent snapshot at the boundary
    WINDOW_NOT_COVERED = "window_not_covered"  # sliding-window tokens not stored
    LAYOUT_MISMATCH = "layout_mismatch"  # stored payload unusable for this layout
    CORRUPT = "corrupt"  # checksum or decode failure on the SSD tier
    TOKEN_MISMATCH = "token_mismatch"  # key matched but stored token ids differ


@dataclass(slots=True)
class Stats:
    """Counters of one PrefixCache (tier gauges are added by ``snapshot``)."""

    num_fetches: int = 0
    num_hits: int = 0
    num_misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hot_block_hits: int = 0
    ssd_block_hits: int = 0
    num_stores: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    num_spills: int = 0
    num_promotions: int = 0
    upgraded_blocks: int = 0
    num_discarded: int = 0
    miss_reasons: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in MissReason})

    def miss(self, reason: MissReason) -> None:
        self.miss_reasons[reason.value] += 1

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["miss_reasons"] = dict(self.miss_reasons)
        return out


# name -> (prometheus type, help); names missing here are exported as gauges.
_COUNTERS = {
    "num_fetches": "fetch calls",
    "num_hits": "fetches that reused at least one block",
    "num_misses": "fetches that reused nothing",
    "prompt_tokens": "prompt tokens seen by fetch",
    "cached_tokens": "prompt tokens served from the cache",
    "hot_block_hits": "blocks served from the hot tier",
    "ssd_block_hits": "blocks served from the ssd tier",
    "num_stores": "store calls",
    "stored_blocks": "new blocks stored",
    "stored_bytes": "payload bytes of new blocks stored",
    "upgraded_blocks": "stored blocks given payloads they lacked by a later capture",
    "num_spills": "hot blocks written to the ssd tier",
    "num_promotions": "ssd blocks copied into the hot tier",
    "num_discarded": "blocks evicted from hot and not kept anywhere",
}


def _metric_name(key: str) -> str:
    name = key.removeprefix("num_")
    return f"prefixcache_{name}"


def prometheus_text(stats: dict[str, object]) -> str:
    """Render a ``PrefixCache.stats()`` dict in the Prometheus text format."""
    lines: list[str] = []
    for key, value in stats.items():
        if key == "miss_reasons":
            lines += [
                "# HELP prefixcache_misses_by_reason_total fetch misses by reason",
                "# TYPE prefixcache_misses_by_reason_total counter",
            ]
            lines += [
                f'prefixcache_misses_by_reason_total{{reason="{r}"}} {n}'
                for r, n in value.items()  # type: ignore[union-attr]
            ]
        elif isinstance(value, dict):
            for sub, sub_value in value.items():
                lines += _one(f"{key}_{sub}", sub_value)
        else:
            lines += _one(key, value)
    return "\n".join(lines) + "\n"


def _one(key: str, value: object) -> list[str]:
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        return []
    help_text = _COUNTERS.get(key) or _COUNTERS.get(key.split("_", 1)[-1])
    if help_text is not None:
        name = _metric_name(key) + "_total"
        return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
    name = _metric_name(key)
    return [f"# TYPE {name} gauge", f"{name} {value}"]
