"""A sweep's plot: hit rate and SSD bytes written per day against the budget swept."""

from __future__ import annotations

from collections.abc import Sequence


def plot_sweep(path: str, docs: Sequence[dict]) -> None:
    """Draw ``docs`` (one per point; the swept tier is the one whose budget varies)."""
    import matplotlib.pyplot as plt

    tier = next((t for t in ("hot", "ssd", "remote") if len({d[t] for d in docs}) > 1), "hot")
    xs = [(d[tier] or 0) / 2**30 for d in docs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(
        xs, [100 * d["hit_rate_last_half"] for d in docs], marker="o", label=docs[0]["eviction"]
    )
    top.set_ylabel("hit rate, last half (%)")
    top.legend()
    bottom.plot(xs, [d["ssd_bytes_written_per_day"] / 2**40 for d in docs], marker="o")
    bottom.set_ylabel("SSD writes (TiB/day)")
    bottom.set_xlabel(f"{tier} budget (GiB)")
    bottom.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
