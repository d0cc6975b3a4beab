"""The shape of ``PrefixCache.stats()``: one ``TypedDict`` per tier and the whole dict.

``pc.stats()["hot"]["nbytes"]`` type-checks; what each key means is in
docs/stats.md. Counters (``num_*``, ``*_bytes`` totals, ``*_hits``) only grow
over a cache's life; gauges (``nbytes``, ``queue_*``, ``enabled``,
``breaker_open``, speeds) are the value at the call. Sizes are in bytes. A test
checks these declarations against what a real cache returns with every tier
on, so a key added to a tier must be declared here.
"""

from __future__ import annotations

from typing import TypedDict


class HotStats(TypedDict):
    """``stats()["hot"]``: the hot tier (live arrays in RAM)."""

    num_blocks: int
    nbytes: int
    max_bytes: int
    num_evictions: int
    num_shed_snapshots: int
    num_refused: int  # newcomers the eviction policy did not admit
    pinned_bytes: int
    num_recent: int
    recent_bytes: int
    num_recent_hits: int
    run_dead_bytes: int  # runs' bytes whose blocks are gone (hot_run_tokens), in nbytes
    num_runs_compacted: int


class RamStats(TypedDict):
    """``stats()["ram"]``: every byte the cache holds in RAM, now, and its bound.

    ``hot_bytes`` (blocks and kept sequences, bounded by ``hot_max_bytes``),
    ``queued_bytes`` (blocks waiting for the ssd and remote writers, each queue
    bounded by ``write_queue_bytes``), ``loading_bytes`` (a block a promotion or
    prefetch is loading, at most one), their sum ``nbytes``, and ``max_bytes``:
    the hot budget plus every writer's queue bound.
    """

    hot_bytes: int
    queued_bytes: int
    loading_bytes: int
    nbytes: int
    max_bytes: int


class SsdStats(TypedDict):
    """``stats()["ssd"]``: the SSD tier (absent with ``hot_cache_only``)."""

    enabled: int
    num_blocks: int
    nbytes: int
    num_corrupt_total: int
    max_bytes: int
    queue_depth: int
    queue_bytes: int
    queue_max_bytes: int
    num_write_failures: int
    num_writes: int
    written_bytes: int
    num_dropped_writes: int
    num_inline_writes: int
    num_existing: int
    num_no_room: int
    num_evictions: int
    num_failures: int
    num_disk_full: int
    num_recoveries: int
    num_corrupt: int
    num_read_errors: int
    num_loads: int
    load_bytes: int
    num_pending_loads: int
    written_bytes_today: int
    write_budget: int
    write_budget_left: int
    pinned_bytes: int
    num_pinned: int


class RemoteStats(TypedDict):
    """``stats()["remote"]``: the remote tier (present when ``remote_url`` is set)."""

    breaker_open: int
    num_breaker_trips: int
    num_errors: int
    num_timeouts: int
    num_skipped: int
    queue_depth: int
    queue_bytes: int
    queue_max_bytes: int
    num_write_failures: int
    num_writes: int
    written_bytes: int
    num_dropped_writes: int
    num_no_room: int
    num_loads: int
    load_bytes: int
    num_missing_parts: int
    num_corrupt: int
    num_gate_refusals: int
    num_gate_probes: int
    fetch_bytes_per_s: int
    prefill_tokens_per_s: int
    num_shards: int
    num_shards_down: int
    num_slot_map_reads: int
    num_moved: int
    off: int
    num_forged: int
    num_removed: int


class WarmStats(TypedDict):
    """``stats()["warm"]``: the warm start on open (present when ``warm_bytes`` > 0)."""

    num_blocks: int
    nbytes: int
    done: int
    seconds: float


class EventStats(TypedDict):
    """``stats()["events"]``: the KV events publisher (present with ``events_url``)."""

    num_events: int
    num_batches: int
    num_dropped: int
    num_subscribers: int


class TenantTierStats(TypedDict):
    """``stats()["tenants"][name][tier]``: one tenant's share of a tier (tenant shares);
    on the SSD tier, of payload file bytes, every process's (kept in its index)."""

    num_blocks: int
    nbytes: int
    floor_bytes: int
    cap_bytes: int  # -1: no cap
    num_stored: int  # = num_blocks + num_evicted + num_removed
    num_evicted: int
    num_cap_evictions: int  # of num_evicted: for this tenant's own cap
    num_removed: int
    num_refused: int


class TenantStats(TypedDict, total=False):
    """``stats()["tenants"][name]``: one tenant, per tier (hot with hot tenant shares;
    ssd whenever the SSD tier is on; remote with remote tenant shares)."""

    hot: TenantTierStats
    ssd: TenantTierStats
    remote: TenantTierStats


class _Optional(TypedDict, total=False):
    """The tiers below hot and the services, each present only when configured."""

    ssd: SsdStats
    remote: RemoteStats
    warm: WarmStats
    events: EventStats
    shared: dict[str, int]  # once a fetch(shared=True) ran: docs/shared-prefix.md
    tenants: dict[str, TenantStats]  # with tenant shares (hot_/ssd_tenant_floors / _caps)


class CacheStats(_Optional):
    """``PrefixCache.stats()``: the cache's counters, then one dict per tier."""

    num_fetches: int
    num_hits: int
    num_misses: int
    prompt_tokens: int
    cached_tokens: int
    num_stores: int
    stored_blocks: int
    stored_bytes: int
    num_spills: int
    num_promotions: int
    upgraded_blocks: int
    num_discarded: int
    prefetched_blocks: int
    prefetch_hits: int
    prefetch_wasted_bytes: int
    miss_reasons: dict[str, int]  # every MissReason value -> fetches that stopped for it
    hot_block_hits: int
    ssd_block_hits: int
    remote_block_hits: int
    num_pinned: int
    num_sessions: int
    ssd_bytes_written: int
    ssd_writes_deferred: int
    ssd_writes_skipped: int
    hot: HotStats
    ram: RamStats
