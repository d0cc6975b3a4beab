"""A sweep's plot: hit rate and SSD bytes written per day (when an SSD tier wrote
any) against the budget swept, one line per policy, the ceiling dashed."""

from __future__ import annotations

from collections.abc import Sequence


def plot_sweep(path: str, docs: Sequence[dict]) -> None:
    """Draw ``docs`` (one per point; the last: the ceiling; the swept tier is the one
    whose budget varies)."""
    import matplotlib.pyplot as plt

    *points, ceiling = docs
    tier = next((t for t in ("hot", "ssd", "remote") if len({d[t] for d in points}) > 1), "hot")
    writes = any(d["ssd_bytes_written_per_day"] for d in points)
    fig, axes = plt.subplots(2 if writes else 1, 1, figsize=(7, 7 if writes else 4), sharex=True)
    top, bottom = (axes[0], axes[1]) if writes else (axes, axes)
    for policy in dict.fromkeys(d["eviction"] for d in points):
        mine = [d for d in points if d["eviction"] == policy]
        xs = [(d[tier] or 0) / 2**30 for d in mine]
        top.plot(xs, [100 * d["hit_rate_last_half"] for d in mine], marker="o", label=policy)
        if writes and policy != "optimal":
            written = [d["ssd_bytes_written_per_day"] / 2**40 for d in mine]
            bottom.plot(xs, written, marker="o", label=policy)
    top.axhline(100 * ceiling["hit_rate_last_half"], linestyle="--", color="gray", label="ceiling")
    top.set_ylabel("hit rate, last half (%)")
    top.legend()
    if writes:
        bottom.set_ylabel("SSD writes (TiB/day)")
    bottom.set_xlabel(f"{tier} budget (GiB)")
    bottom.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
