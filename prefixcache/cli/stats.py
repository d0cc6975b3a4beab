"""``prefixcache stats``: what an SSD tier directory holds, in total and per model
and namespace, with the hit counters saved there; ``--remote-url`` reports a
remote tier's server instead."""

from __future__ import annotations

import argparse
import functools
import shutil

from ..stats import Stats, add_counters
from ..tiers.ssd.index import FORMAT_NAME, FORMAT_VERSION
from ..tiers.ssd.inventory import Inventory, NamespaceInfo
from ..tiers.ssd.view import SsdView
from .common import Doc, emit, ssd_command
from .remote import with_remote
from .report import format_bytes, table


def cmd_stats(view: SsdView, args: argparse.Namespace) -> int:
    inv = Inventory.load(view)
    counters = view.records.counters()
    limits = view.records.limits() or {}
    disk = shutil.disk_usage(view.path)
    namespaces = [_ns_doc(inv, inv.namespaces[r], counters.get(r)) for r in inv.roots()]
    namespaces = [ns for ns in namespaces if ns["num_blocks"] or ns["counters"] is not None]
    models: dict[str | None, Doc] = {}
    for ns in namespaces:
        m = models.setdefault(
            ns["model"],
            {
                "model": ns["model"],
                "num_namespaces": 0,
                "num_blocks": 0,
                "num_tokens": 0,
                "nbytes": 0,
                "counters": _counters(None),
            },
        )
        m["num_namespaces"] += 1
        for name in ("num_blocks", "num_tokens", "nbytes"):
            m[name] += ns[name]
        m["counters"] = add_counters(m["counters"], ns["counters"] or {})
    totals = view.index.totals()
    doc = {
        "ssd_dir": view.path,
        "format": {"name": FORMAT_NAME.decode(), "version": FORMAT_VERSION},
        "num_blocks": len(inv.entries),
        "num_tokens": sum(e.num_tokens for e in inv.entries.values()),
        "nbytes": sum(e.file_bytes for e in inv.entries.values()),
        "num_bad_entries": len(inv.bad),
        "num_corrupt_total": totals["num_corrupt_total"],
        "max_bytes": limits.get("max_bytes"),
        "min_free_bytes": limits.get("min_free_bytes"),
        **_governance_doc(view, limits.get("write_budget", 0)),
        "disk": {"total_bytes": disk.total, "free_bytes": disk.free},
        "other_pids": view.records.other_pids(),
        "models": sorted(models.values(), key=lambda m: m["model"] or ""),
        "namespaces": namespaces,
        "counters": functools.reduce(
            add_counters, [ns["counters"] or {} for ns in namespaces], _counters(None)
        ),
    }
    emit(args, doc, lambda: _stats_text(doc))
    return 0


def _governance_doc(view: SsdView, budget: int) -> Doc:
    """Bytes written today (UTC), the write budget (the last writer's; 0: none) and
    what is left of it now, and the pins in force (the keys of ``stats()["ssd"]``)."""
    level, today = view.index.written(budget)
    pins = view.index.pins()
    return {
        "written_bytes_today": today,
        "write_budget": budget,
        "write_budget_left": max(0, int(budget - level)) if budget else None,
        "num_pinned": len(pins),
        "pinned_bytes": sum(nbytes for _, nbytes in pins.values()),
    }


def _ns_doc(inv: Inventory, ns: NamespaceInfo, counters: dict | None) -> Doc:
    blocks = inv.blocks([ns.root])
    return {
        "root": ns.root.hex(),
        "model": ns.model,
        "extra": dict(ns.extra),
        "kv_quant": list(ns.kv_quant) if ns.kv_quant else None,
        "num_layers": ns.num_layers,
        "num_blocks": len(blocks),
        "num_tokens": sum(e.num_tokens for e in blocks),
        "nbytes": sum(e.file_bytes for e in blocks),
        "num_chains": len(inv.leaves([ns.root])),
        "last_used": max((e.last_used for e in blocks), default=None),
        "counters": _counters(counters) if counters is not None else None,
    }


def _counters(saved: dict | None) -> Doc:
    """Every Stats counter (zero if never saved), so the keys are stable."""
    return add_counters(Stats().as_dict(), saved or {})


def _stats_text(doc: Doc) -> str:
    cap = doc["max_bytes"]
    used = format_bytes(doc["nbytes"])
    if cap:
        used += f" of {format_bytes(cap)} cap ({100 * doc['nbytes'] / cap:.1f}%)"
    disk = doc["disk"]
    lines = [
        f"SSD tier {doc['ssd_dir']} ({doc['format']['name']} v{doc['format']['version']})",
        f"  {doc['num_blocks']} blocks, {doc['num_tokens']} tokens, {used}",
        f"  disk: {format_bytes(disk['free_bytes'])} free of {format_bytes(disk['total_bytes'])}",
    ]
    lines.append(_writes_text(doc))
    if doc["num_pinned"]:
        lines.append(f"  pinned: {doc['num_pinned']} blocks, {format_bytes(doc['pinned_bytes'])}")
    if doc["other_pids"]:
        lines.append(f"  open in: pid {', '.join(map(str, doc['other_pids']))}")
    if doc["num_bad_entries"] or doc["num_corrupt_total"]:
        lines.append(
            f"  unreadable entries: {doc['num_bad_entries']}, "
            f"corrupt blocks quarantined so far: {doc['num_corrupt_total']}"
        )
    lines += ["", _models_table(doc["models"]) if doc["models"] else "(no blocks)"]
    reasons = {k: v for k, v in doc["counters"]["miss_reasons"].items() if v}
    if reasons:
        lines.append("")
        lines.append("miss reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    return "\n".join(lines)


def _models_table(models: list[Doc]) -> str:
    """One row per model: its blocks and its hit counters."""
    rows = []
    for m in models:
        c = m["counters"]
        rate = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        rows.append(
            [
                m["model"] or "(unrecorded)",
                m["num_blocks"],
                m["num_tokens"],
                format_bytes(m["nbytes"]),
                c["num_fetches"],
                c["num_hits"],
                f"{c['cached_tokens']}/{c['prompt_tokens']} ({100 * rate:.0f}%)",
                c["hot_block_hits"],
                c["ssd_block_hits"],
            ]
        )
    heads = (
        "model",
        "blocks",
        "tokens",
        "size",
        "fetches",
        "hits",
        "cached tokens",
        "hot hits",
        "ssd hits",
    )
    return table(heads, rows, "lrrrrrrrr")


def _writes_text(doc: Doc) -> str:
    written = f"  written today (UTC): {format_bytes(doc['written_bytes_today'])}"
    if not doc["write_budget"]:
        return written + "; no write budget"
    budget, left = format_bytes(doc["write_budget"]), format_bytes(doc["write_budget_left"])
    return f"{written}; write budget {budget} per day, {left} left"


_STATS_HELP = "blocks, tokens, bytes and hit counters per model (--remote-url: per server)"
COMMANDS = (with_remote(ssd_command("stats", _STATS_HELP, cmd_stats)),)
