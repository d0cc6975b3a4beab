"""The sustained scenario's samples as a CSV and a PNG (matplotlib, the ``dev`` extra)."""

from __future__ import annotations

import csv

MiB = 1 << 20
# (panel title, columns in MiB) then (title, plain columns)
PANELS = (
    ("memory (MiB)", ("rss", "mlx_active", "ram_total", "ram_max"), True),
    ("cache RAM by part (MiB)", ("ram_hot", "ram_queued", "ram_loading"), True),
    ("SSD", ("ssd_on_disk",), True),
    ("blocks", ("blocks_written", "dropped_writes", "queue_depth"), False),
    ("hit share (cached / prompt tokens)", ("hit_share",), False),
    ("time to first token (ms, median)", ("ttft_ms",), False),
)


def write(rows: list[dict[str, float]], columns: tuple[str, ...], prefix: str) -> str:
    """Write ``prefix``.csv and (if matplotlib is installed) ``prefix``.png; their names."""
    with open(prefix + ".csv", "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=[c for c in columns if rows and c in rows[0]])
        out.writeheader()
        out.writerows({k: r[k] for k in out.fieldnames} for r in rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return prefix + ".csv (no matplotlib: no plot)"
    panels = [p for p in PANELS if rows and any(c in rows[0] for c in p[1])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), sharex=True)
    x = [r["seconds"] for r in rows]
    for ax, (title, cols, in_mib) in zip(axes, panels, strict=True):
        for col in (c for c in cols if c in rows[0]):
            scale = MiB if in_mib else 1
            ax.plot(x, [r[col] / scale for r in rows], label=col)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=80)
    plt.close(fig)
    return f"{prefix}.csv, {prefix}.png"
