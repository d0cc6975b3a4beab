"""``prefixcache stats`` and ``ls``: what an SSD tier directory holds, per model and per block.

``stats`` builds one document: totals, the cap and the disk, writes against the
budget, pins, and per model and namespace the blocks with their saved hit
counters (``--remote-url``: a remote tier's server instead). ``ls`` lists the
blocks, or the chains, one row each, filtered by model, age, size and pins,
and sorted.
"""

from __future__ import annotations

import argparse
import functools
import math
import shutil
import time

from ..config import parse_bytes
from ..stats import Stats, add_counters
from ..tiers.hot.tenants import COUNTERS
from ..tiers.ssd.admin.inventory import Entry, Inventory, NamespaceInfo, end_token
from ..tiers.ssd.admin.view import SsdView
from ..tiers.ssd.version import FORMAT_NAME
from .common import Doc, UsageError, count, duration, emit, model_roots, ssd_command
from .remote import with_remote
from .report import format_age, format_bytes, table
from .stats_text import stats_text


def add_ls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model id (or 4+ hex digits of a namespace root key)")
    p.add_argument("--chains", action="store_true", help="one row per chain (leaf block)")
    p.add_argument("--older-than", type=duration, help="last used before, e.g. 7d, 12h")
    p.add_argument("--newer-than", type=duration, help="last used within, e.g. 30m")
    p.add_argument("--min-bytes", type=parse_bytes, help="at least this size, e.g. 1M")
    p.add_argument(
        "--sort",
        choices=("age", "size", "tokens"),
        default="age",
        help="age: most recently used first; size, tokens: largest first",
    )
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--limit", type=count, help="print at most this many rows")
    p.add_argument("--pinned", action="store_true", help="only pinned blocks (chains holding one)")


# -- stats ----------------------------------------------------------------------


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
        "format": {"name": FORMAT_NAME.decode(), "version": view.index.format_version},
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
    doc["tenants"], doc["ssd_tenants"] = _tenants(doc["counters"], view, args.tenant)
    emit(args, doc, lambda: stats_text(doc))
    return 0


def _tenants(counters: Doc, view: SsdView, only: str | None) -> tuple[Doc, Doc]:
    """The hot tier's saved per-tenant counters (``"<tenant>.<counter>"``) by tenant,
    and the SSD tier's figures per tenant (kept in its index); ``only``: that
    tenant's (UsageError naming it when neither has it)."""
    out: Doc = {}
    for name, value in counters.get("tenants", {}).items():
        tenant, _, key = name.rpartition(".")
        out.setdefault(tenant, dict.fromkeys(COUNTERS, 0))[key] = value  # 0s are not saved
    ssd = view.index.tenants()
    if only is None:
        return out, ssd
    if only not in out and only not in ssd:
        known = ", ".join(repr(t) for t in sorted({*out, *ssd})) or "none saved"
        raise UsageError(f"--tenant {only!r}: no counters of that tenant ({known})")
    return {k: v for k, v in out.items() if k == only}, {k: v for k, v in ssd.items() if k == only}


def add_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", help="only this tenant's counters (tenant shares)")


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


def cmd_ls(view: SsdView, args: argparse.Namespace) -> int:
    inv = Inventory.load(view)
    roots = model_roots(inv, args.model)
    labels = {r: inv.namespaces[r].label for r in roots}
    rows = (
        [_chain_row(inv, e) for e in inv.leaves(roots)]
        if args.chains
        else [_block_row(inv, e) for e in inv.blocks(roots)]
    )
    pins = view.index.pins()
    for row in rows:
        key = bytes.fromhex(row["key"])
        _pin_fields(row, [e.key for e in inv.chain(key)[0]] if args.chains else [key], pins)
    if args.pinned:
        rows = [r for r in rows if r["pinned"]]
    now = time.time()
    if args.older_than is not None:
        rows = [r for r in rows if now - r["last_used"] > args.older_than]
    if args.newer_than is not None:
        rows = [r for r in rows if now - r["last_used"] <= args.newer_than]
    if args.min_bytes is not None:
        rows = [r for r in rows if r["nbytes"] >= args.min_bytes]
    sort_key = {"age": "last_used", "size": "nbytes", "tokens": "prefix_tokens"}[args.sort]
    rows.sort(key=lambda r: (r[sort_key], r["key"]), reverse=not args.reverse)
    doc = {
        "ssd_dir": view.path,
        "kind": "chains" if args.chains else "blocks",
        "num_matched": len(rows),
        "rows": rows[: args.limit],
    }
    doc["pinned_only"] = args.pinned
    emit(args, doc, lambda: _ls_text(doc, labels, now))
    return 0


def _pin_fields(row: Doc, keys: list[bytes], pins: dict[bytes, tuple[float, int]]) -> None:
    """A listing row's ``pinned`` (one of its blocks ``keys`` is) and ``pinned_until``
    (the earliest end among them, Unix time; None: never)."""
    ends = [pins[k][0] for k in keys if k in pins]
    row["pinned"] = bool(ends)
    row["pinned_until"] = min(ends) if ends and math.isfinite(min(ends)) else None


def _block_row(inv: Inventory, e: Entry) -> Doc:
    parent = inv.entries.get(e.parent)
    end = end_token(e.index, e.num_tokens, parent and parent.num_tokens)
    return {
        "key": e.key.hex(),
        "model": inv.namespaces[e.root].model,
        "root": e.root.hex(),
        "index": e.index,
        "num_tokens": e.num_tokens,
        "prefix_tokens": end,
        "nbytes": e.file_bytes,
        "payload_nbytes": e.nbytes,
        "created": e.created,
        "last_used": e.last_used,
        "num_children": len(inv.children.get(e.key, ())),
        "detached": inv.link_error(e) is not None,
    }


def _chain_row(inv: Inventory, leaf: Entry) -> Doc:
    chain, missing = inv.chain(leaf.key)
    return {
        "key": leaf.key.hex(),
        "model": inv.namespaces[leaf.root].model,
        "root": leaf.root.hex(),
        "num_blocks": len(chain),
        "prefix_tokens": sum(e.num_tokens for e in chain),
        "nbytes": sum(e.file_bytes for e in chain),
        "created": leaf.created,
        "last_used": leaf.last_used,
        "complete": missing is None,
    }


def _ls_text(doc: Doc, labels: dict[bytes, str], now: float) -> str:
    rows = doc["rows"]
    label = {r.hex(): name for r, name in labels.items()}
    if doc["kind"] == "chains":
        heads = ("leaf key", "model", "blocks", "tokens", "size", "used", "complete")
        body = [
            [
                r["key"],
                label[r["root"]],
                r["num_blocks"],
                r["prefix_tokens"],
                format_bytes(r["nbytes"]),
                format_age(now - r["last_used"]) + " ago",
                "yes" if r["complete"] else "no",
            ]
            for r in rows
        ]
        align = "llrrrrl"
    else:
        heads = ("key", "model", "block", "tokens", "size", "used", "children")
        body = [
            [
                r["key"],
                label[r["root"]],
                r["index"],
                f"{r['prefix_tokens'] - r['num_tokens']}-{r['prefix_tokens']}",
                format_bytes(r["nbytes"]),
                format_age(now - r["last_used"]) + " ago",
                r["num_children"],
            ]
            for r in rows
        ]
        align = "llrrrrr"
    if doc["pinned_only"]:
        heads, align = (*heads, "pin ends"), align + "r"
        body = [[*b, _pin_end(r["pinned_until"], now)] for b, r in zip(body, rows, strict=True)]
    more = doc["num_matched"] - len(rows)
    tail = f"\n... {more} more (--limit)" if more > 0 else ""
    return (table(heads, body, align) if rows else f"(no {doc['kind']} match)") + tail


def _pin_end(until: float | None, now: float) -> str:
    return "never" if until is None else "in " + format_age(until - now)


_STATS_HELP = "blocks, tokens, bytes and hit counters per model (--remote-url: per server)"
COMMANDS = (
    with_remote(ssd_command("stats", _STATS_HELP, cmd_stats, add_stats_args)),
    ssd_command("ls", "list blocks (or chains), filtered and sorted", cmd_ls, add_ls_args),
)
