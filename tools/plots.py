"""The README's two plots, drawn from the benchmarks' CSV output (``make plots``).

  docs/reuse_per_arch.png   cached prompt tokens per architecture through
                            ``prefixcache serve``, plain ``mlx_lm.server`` and
                            vllm-mlx (``bench_reuse_serve.py --csv``)
  docs/budget.png           TTFT and cached share against the cache's RAM budget,
                            the same chats through real servers
                            (``bench_serve_http.py --lockstep --csv``)

The CSVs are kept in docs/data/, so the plots redraw without re-running the
benchmarks; re-run a benchmark with ``--csv`` into docs/data/ to refresh one.

    python tools/plots.py
    python tools/plots.py --reuse docs/data/reuse_serve.csv --out docs
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
# one colour per server in both plots
COLOURS = {
    "ours": "#1f77b4",
    "ours + SSD": "#1f77b4",
    "ours hot-only": "#6baed6",
    "mlx-lm": "#ff7f0e",
    "vllm-mlx": "#2ca02c",
}
LABELS = {
    "ours": "prefixcache serve (hot + SSD)",
    "ours + SSD": "prefixcache serve, hot + SSD",
    "ours hot-only": "prefixcache serve, hot only",
    "mlx-lm": "mlx_lm.server",
    "vllm-mlx": "vllm-mlx",
}


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def plot_reuse(rows: list[dict[str, str]], out: Path) -> None:
    """Grouped bars: per arch, each caching server's cached tokens of right replies,
    with the cached tokens of wrong replies stacked above them, hatched."""
    servers = [s for s in ("mlx-lm", "vllm-mlx", "ours") if any(r["server"] == s for r in rows)]
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    by = {(r["arch"], r["server"]): r for r in rows}
    width = 0.8 / len(servers)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, server in enumerate(servers):
        xs = [a + (i - (len(servers) - 1) / 2) * width for a in range(len(archs))]
        right = [_int(by.get((arch, server)), "valid_cached_tokens") / 1e3 for arch in archs]
        wrong = [
            (_int(by.get((a, server)), "cached_tokens") / 1e3) - r
            for a, r in zip(archs, right, strict=True)
        ]
        ax.bar(xs, right, width, color=COLOURS[server], label=LABELS[server])
        ax.bar(xs, wrong, width, bottom=right, color="none", edgecolor=COLOURS[server],
               hatch="///", linewidth=0)  # fmt: skip
        for x, arch in zip(xs, archs, strict=True):
            row = by.get((arch, server))
            # errors count the probes too: at least one per request means every one failed
            failed = row is None or row["failure"] or int(row["errors"]) >= int(row["requests"])
            if failed or _int(row, "cached_tokens") == 0:
                ax.annotate("failed" if failed else "0", (x, 0.1), ha="center", va="bottom",
                            rotation=90, fontsize=8, color=COLOURS[server])  # fmt: skip
    ax.bar([0], [0], color="none", edgecolor="grey", hatch="///", label="cached, reply wrong")
    ax.set_xticks(range(len(archs)), archs, rotation=15)
    ax.set_xlabel("architecture (tiny random-weight mlx-lm model)")
    ax.set_ylabel("cached prompt tokens (thousands)")
    ax.set_title("Prompt tokens reused on the same chats, per server (bench_reuse_serve)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=4, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _int(row: dict[str, str] | None, key: str) -> int:
    return int(row[key]) if row and row[key] else 0


def plot_budget(rows: list[dict[str, str]], out: Path) -> None:
    """Four panels against the budget: TTFT p50 and p90 (ms), TTFT per request over
    mlx-lm's (the median of paired ratios), cached share (%)."""
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        series[r["system"]].append(r)
    panels = (
        ("ttft_p50_ms", "TTFT, median (ms)", 1.0),
        ("ttft_p90_ms", "TTFT, 90th percentile (ms)", 1.0),
        ("paired", "TTFT per request / mlx_lm.server's\n(median of paired ratios)", 1.0),
        ("cached_share", "prompt tokens cached (%)", 100.0),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    budgets = sorted({float(r["budget_mib"]) for r in rows})
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=True):
        for system, points in series.items():
            points = sorted((r for r in points if r[key] != ""), key=_budget)
            ax.plot([_budget(r) for r in points], [float(r[key]) * scale for r in points],
                    marker="o", color=COLOURS[system], label=LABELS[system],
                    linestyle="--" if system == "ours hot-only" else "-")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.set_xlabel("cache RAM budget (MiB)")
        ax.set_ylabel(label)
        ax.set_ylim(0, 100 if key == "cached_share" else None)
        ax.grid(alpha=0.3)
    axes.flat[2].axhline(1.0, color="grey", linewidth=0.8)
    axes.flat[0].legend(fontsize=9)
    fig.suptitle(
        "The same chats through real servers at equal cache RAM, restarted halfway\n"
        "(bench_serve_http --lockstep; 2 shared CPU cores: the timings move with the load)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _budget(row: dict[str, str]) -> float:
    return float(row["budget_mib"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reuse", type=Path, default=DATA / "reuse_serve.csv")
    p.add_argument("--budget", type=Path, default=DATA / "serve_http.csv")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder of the PNGs")
    args = p.parse_args()
    plot_reuse(read_csv(args.reuse), args.out / "reuse_per_arch.png")
    plot_budget(read_csv(args.budget), args.out / "budget.png")
    print(f"wrote {args.out / 'reuse_per_arch.png'} and {args.out / 'budget.png'}")


if __name__ == "__main__":
    main()
