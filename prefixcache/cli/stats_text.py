"""The text ``prefixcache stats`` prints for an SSD tier directory (``--json``
prints the document itself): size against the cap, disk, writes today and the
budget, pins, and one line per model with its counters."""

from __future__ import annotations

from .common import Doc
from .report import format_bytes, table


def stats_text(doc: Doc) -> str:
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
    rows = [_model_row(m) for m in doc["models"]]
    lines += ["", table(_MODEL_HEADS, rows, "lrrrrrrrr")] if rows else ["", "(no blocks)"]
    if doc.get("tenants"):
        heads = ("tenant", "stored", "evicted", "for its cap", "removed", "refused")
        keys = ("num_stored", "num_evicted", "num_cap_evictions", "num_removed", "num_refused")
        rows = [[repr(t), *(c.get(k, 0) for k in keys)] for t, c in doc["tenants"].items()]
        lines += ["", "hot tier per tenant (blocks):", table(heads, rows, "lrrrrr")]
    if doc.get("ssd_tenants"):  # kept in the index: every process's, since it was made
        heads = ("tenant", "held", "bytes", "stored", "evicted", "for its cap", "removed")
        keys = ("num_blocks", "nbytes", "num_stored", "num_evicted", "num_cap_evictions")
        rows = [
            [repr(t), *(f[k] for k in keys), f["num_removed"], f["num_refused"]]
            for t, f in doc["ssd_tenants"].items()
        ]
        heads = (*heads, "refused")
        lines += ["", "ssd tier per tenant (blocks):", table(heads, rows, "lrrrrrrr")]
    reasons = {k: v for k, v in doc["counters"]["miss_reasons"].items() if v}
    if reasons:
        lines.append("")
        lines.append("miss reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    return "\n".join(lines)


_MODEL_HEADS = (
    *("model", "blocks", "tokens", "size", "fetches", "hits"),
    *("cached tokens", "hot hits", "ssd hits"),
)


def _model_row(m: Doc) -> list:
    """One model's line of ``stats``: its blocks and its counters."""
    c = m["counters"]
    rate = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
    blocks = [m["model"] or "(unrecorded)", m["num_blocks"], m["num_tokens"]]
    cached = f"{c['cached_tokens']}/{c['prompt_tokens']} ({100 * rate:.0f}%)"
    hits = [c["num_fetches"], c["num_hits"], cached, c["hot_block_hits"], c["ssd_block_hits"]]
    return [*blocks, format_bytes(m["nbytes"]), *hits]


def _writes_text(doc: Doc) -> str:
    written = f"  written today (UTC): {format_bytes(doc['written_bytes_today'])}"
    if not doc["write_budget"]:
        return written + "; no write budget"
    budget, left = format_bytes(doc["write_budget"]), format_bytes(doc["write_budget_left"])
    return f"{written}; write budget {budget} per day, {left} left"


# -- ls -------------------------------------------------------------------------
