"""The Prometheus text exposition (0.0.4) of a ``PrefixCache.stats()`` dict: each
stats key's metric name, type and help, gauges named after keys not listed, and the
per-tenant series. Served at ``/metrics`` by ``serve/metrics.py``."""

from __future__ import annotations

import re
from collections.abc import Mapping

# stats() key (``tier.key`` for a tier's dict) -> (metric name, type, help). Counters
# end in ``_total``; sizes are in bytes and say so. Keys missing here are gauges
# named after the key (``num_`` dropped, ``nbytes`` -> ``bytes``).
_C, _G = "counter", "gauge"
_METRICS: dict[str, tuple[str, str, str]] = {
    "num_fetches": ("fetches_total", _C, "fetch calls"),
    "num_hits": ("hits_total", _C, "fetches that reused at least one block"),
    "num_misses": ("misses_total", _C, "fetches that reused nothing"),
    "prompt_tokens": ("prompt_tokens_total", _C, "prompt tokens seen by fetch"),
    "cached_tokens": ("cached_tokens_total", _C, "prompt tokens served from the cache"),
    "hot_block_hits": ("hot_block_hits_total", _C, "blocks served from the hot tier"),
    "ssd_block_hits": ("ssd_block_hits_total", _C, "blocks served from the ssd tier"),
    "remote_block_hits": ("remote_block_hits_total", _C, "blocks served from the remote tier"),
    "num_stores": ("stores_total", _C, "store calls"),
    "stored_blocks": ("stored_blocks_total", _C, "new blocks stored"),
    "stored_bytes": ("stored_bytes_total", _C, "payload bytes of new blocks stored"),
    "num_spills": ("spills_total", _C, "hot blocks written to the ssd tier"),
    "num_promotions": ("promotions_total", _C, "ssd blocks copied into the hot tier"),
    "upgraded_blocks": ("upgraded_blocks_total", _C, "blocks given payloads a later capture cut"),
    "num_discarded": ("discarded_blocks_total", _C, "blocks evicted from hot, kept nowhere"),
    "prefetched_blocks": ("prefetched_blocks_total", _C, "blocks prefetch promoted into hot"),
    "prefetch_hits": ("prefetch_hits_total", _C, "prefetched blocks a fetch then used"),
    "prefetch_wasted_bytes": (
        "prefetch_wasted_bytes_total",
        _C,
        "prefetched bytes evicted before any fetch used them",
    ),
    "num_rejected": ("rejected_inserts_total", _C, "server inserts refused (type or layout)"),
    "ssd_writes_deferred": (
        "ssd_writes_deferred_total",
        _C,
        "ssd writes postponed (over the write budget)",
    ),
    "ssd_writes_skipped": (
        "ssd_writes_skipped_total",
        _C,
        "blocks never written to ssd (not admitted, no budget)",
    ),
    "ssd_bytes_written": ("ssd_bytes_written_total", _C, "payload file bytes written to ssd"),
    "num_pinned": ("pinned_blocks", _G, "blocks pinned (any tier)"),
    "num_sessions": ("sessions", _G, "sessions with blocks only they hold"),
    "hot.pinned_bytes": ("hot_pinned_bytes", _G, "bytes of pinned blocks in the hot tier"),
    "ssd.pinned_bytes": ("ssd_pinned_bytes", _G, "file bytes of pinned blocks on the ssd tier"),
    "ssd.num_pinned": ("ssd_pinned_blocks", _G, "pins recorded in the ssd index"),
    "ssd.written_bytes_today": ("ssd_written_bytes_today", _G, "ssd bytes written today (UTC)"),
    "ssd.write_budget": ("ssd_write_budget_bytes", _G, "ssd bytes allowed per day (0: none)"),
    "ssd.write_budget_left": ("ssd_write_budget_left_bytes", _G, "ssd write budget left now"),
    "ram.hot_bytes": ("ram_hot_bytes", _G, "bytes the hot tier holds in RAM"),
    "ram.queued_bytes": ("ram_queued_bytes", _G, "bytes queued in RAM for the lower tiers"),
    "ram.loading_bytes": ("ram_loading_bytes", _G, "bytes a promotion or prefetch is loading"),
    "ram.nbytes": ("ram_bytes", _G, "bytes the cache holds in RAM (hot, queues, loading)"),
    "ram.max_bytes": ("ram_max_bytes", _G, "bound of ram_bytes: hot and queue budgets"),
    "ssd.queue_max_bytes": ("ssd_write_queue_max_bytes", _G, "bound of the ssd writer's queue"),
    "remote.queue_max_bytes": (
        "remote_write_queue_max_bytes",
        _G,
        "bound of the remote writer's queue",
    ),
    "hot.num_blocks": ("hot_blocks", _G, "blocks in the hot tier"),
    "hot.nbytes": ("hot_bytes", _G, "payload bytes in the hot tier"),
    "hot.max_bytes": ("hot_max_bytes", _G, "byte budget of the hot tier"),
    "hot.num_evictions": ("hot_evictions_total", _C, "blocks evicted from the hot tier"),
    "hot.num_refused": ("hot_refused_total", _C, "blocks the eviction policy did not admit"),
    "hot.num_recent": ("hot_recent_sequences", _G, "sequences kept whole in the hot tier"),
    "hot.recent_bytes": ("hot_recent_bytes", _G, "bytes of the sequences kept whole"),
    "hot.num_recent_hits": ("hot_recent_hits_total", _C, "fetches given a kept sequence's arrays"),
    "hot.run_dead_bytes": ("hot_run_dead_bytes", _G, "bytes of runs whose blocks are gone"),
    "hot.num_runs_compacted": (
        "hot_runs_compacted_total",
        _C,
        "runs whose blocks were copied out",
    ),
    "ssd.enabled": ("ssd_enabled", _G, "1 while the ssd tier accepts writes (0: disk full)"),
    "ssd.num_blocks": ("ssd_blocks", _G, "blocks indexed in the ssd tier"),
    "ssd.nbytes": ("ssd_bytes", _G, "payload file bytes in the ssd tier"),
    "ssd.num_corrupt_total": (
        "ssd_index_corrupt_blocks_total",
        _C,
        "corrupt blocks quarantined by any process",
    ),
    "ssd.max_bytes": ("ssd_max_bytes", _G, "byte budget of the ssd tier"),
    "ssd.queue_depth": ("ssd_write_queue_blocks", _G, "blocks waiting for the ssd writer"),
    "ssd.queue_bytes": ("ssd_write_queue_bytes", _G, "payload bytes waiting for the ssd writer"),
    "ssd.num_write_failures": ("ssd_write_failures_total", _C, "failed ssd writer batches"),
    "ssd.num_writes": ("ssd_writes_total", _C, "payload files written"),
    "ssd.written_bytes": ("ssd_written_bytes_total", _C, "payload file bytes written"),
    "ssd.num_dropped_writes": ("ssd_dropped_writes_total", _C, "blocks not written (queue, room)"),
    "ssd.num_inline_writes": ("ssd_inline_writes_total", _C, "writes on the caller's thread"),
    "ssd.num_existing": ("ssd_existing_writes_total", _C, "writes skipped: already stored"),
    "ssd.num_no_room": ("ssd_no_room_total", _C, "writes refused by the cap or free disk"),
    "ssd.num_evictions": ("ssd_evictions_total", _C, "blocks evicted from the ssd tier"),
    "ssd.num_disk_full": ("ssd_disk_full_total", _C, "disk-full errors of the ssd tier"),
    "ssd.num_failures": ("ssd_failures_total", _C, "ssd tier failures that turned writes off"),
    "ssd.num_recoveries": ("ssd_recoveries_total", _C, "ssd tier writes turned back on"),
    "ssd.num_read_errors": ("ssd_read_errors_total", _C, "payload reads failed by I/O errors"),
    "num_storage_errors": ("storage_errors_total", _C, "server cache calls failed by storage"),
    "num_generation_restarts": (
        "generation_restarts_total",
        _C,
        "times serve started mlx-lm's generation loop again after it failed",
    ),
    "num_refused_requests": ("refused_requests_total", _C, "requests serve answered with a 4xx"),
    "ssd.num_corrupt": ("ssd_corrupt_blocks_total", _C, "corrupt blocks quarantined here"),
    "ssd.num_loads": ("ssd_loads_total", _C, "payload files read"),
    "ssd.load_bytes": ("ssd_loaded_bytes_total", _C, "payload bytes read"),
    "ssd.num_pending_loads": ("ssd_pending_loads_total", _C, "blocks served from the queue"),
    "remote.breaker_open": ("remote_breaker_open", _G, "1 while the remote breaker skips calls"),
    "remote.num_breaker_trips": ("remote_breaker_trips_total", _C, "times the breaker opened"),
    "remote.num_errors": ("remote_errors_total", _C, "remote calls that failed"),
    "remote.num_timeouts": ("remote_timeouts_total", _C, "remote calls that timed out"),
    "remote.num_skipped": ("remote_skipped_calls_total", _C, "remote calls skipped: breaker open"),
    "remote.queue_depth": ("remote_write_queue_blocks", _G, "blocks waiting for the remote writer"),
    "remote.queue_bytes": ("remote_write_queue_bytes", _G, "bytes waiting for the remote writer"),
    "remote.num_write_failures": ("remote_write_failures_total", _C, "failed remote batches"),
    "remote.num_writes": ("remote_writes_total", _C, "blocks written to the remote server"),
    "remote.written_bytes": ("remote_written_bytes_total", _C, "payload bytes written remotely"),
    "remote.num_dropped_writes": ("remote_dropped_writes_total", _C, "blocks not written remotely"),
    "remote.num_no_room": ("remote_no_room_total", _C, "remote writes refused by the budget"),
    "remote.num_loads": ("remote_loads_total", _C, "blocks fetched from the remote server"),
    "remote.load_bytes": ("remote_loaded_bytes_total", _C, "payload bytes fetched remotely"),
    "remote.num_missing_parts": (
        "remote_missing_parts_total",
        _C,
        "remote blocks with a part evicted or torn",
    ),
    "remote.num_corrupt": ("remote_corrupt_blocks_total", _C, "remote blocks failing checks"),
    "remote.num_gate_refusals": (
        "remote_gate_refusals_total",
        _C,
        "remote restores refused: slower than prefill",
    ),
    "remote.num_gate_probes": ("remote_gate_probes_total", _C, "refused restores let through"),
    "remote.fetch_bytes_per_s": ("remote_fetch_bytes_per_second", _G, "measured remote speed"),
    "remote.prefill_tokens_per_s": ("prefill_tokens_per_second", _G, "measured prefill speed"),
}
_MISSES = "prefixcache_misses_by_reason_total"


def prometheus_text(stats: Mapping[str, object]) -> str:
    """Render a ``PrefixCache.stats()`` dict in the Prometheus text format (0.0.4).

    Every metric gets one HELP and one TYPE line; a name seen twice is emitted once.
    """
    lines: list[str] = []
    seen: set[str] = set()
    for key, value in stats.items():
        if key == "miss_reasons" and isinstance(value, dict):
            lines += [
                f"# HELP {_MISSES} fetches by why they fell short",
                f"# TYPE {_MISSES} counter",
            ]
            lines += [f'{_MISSES}{{reason="{r}"}} {n}' for r, n in value.items()]
        elif key == "tenants" and isinstance(value, dict):
            lines += _tenant_lines(value)
        elif isinstance(value, dict):
            for sub, sub_value in value.items():
                lines += _one(f"{key}.{sub}", sub_value, seen)
        else:
            lines += _one(key, value, seen)
    return "\n".join(lines) + "\n"


def _tenant_lines(tenants: Mapping[str, Mapping[str, Mapping[str, int]]]) -> list[str]:
    """``prefixcache_tenant_<key>{tenant=,tier=}`` per figure of ``stats()["tenants"]``:
    ``num_*`` counts but ``num_blocks`` are counters (``_total``), the rest gauges."""
    series: dict[str, list[str]] = {}
    for tenant, tiers in tenants.items():
        label = tenant.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        for tier, figures in tiers.items():
            for key, value in figures.items():
                series.setdefault(key, []).append(f'{{tenant="{label}",tier="{tier}"}} {value}')
    lines = []
    for key, values in series.items():
        counter = key.startswith("num_") and key != "num_blocks"
        name = "prefixcache_tenant_" + _gauge(key)[0] + ("_total" if counter else "")
        lines += [f"# HELP {name} per tenant and tier: {key} (docs/stats.md)"]
        lines += [f"# TYPE {name} {_C if counter else _G}", *(name + v for v in values)]
    return lines


def _one(key: str, value: object, seen: set[str]) -> list[str]:
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        return []
    name, kind, help_text = _METRICS.get(key) or _gauge(key)
    name = "prefixcache_" + name
    if name in seen:
        return []
    seen.add(name)
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]


def _gauge(key: str) -> tuple[str, str, str]:
    parts = [p.removeprefix("num_").replace("nbytes", "bytes") for p in key.split(".")]
    name = re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(parts)).removesuffix("_total")
    return name, _G, key
