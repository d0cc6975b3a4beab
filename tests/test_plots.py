"""tools/plots.py draws the README's plots from the CSVs the benchmarks write with --csv
(docs/data/), and the committed CSVs carry the columns it reads."""

from __future__ import annotations

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import plots
from benchlib import write_csv

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_committed_csvs_redraw_both_plots(tmp_path):
    plots.plot_reuse(plots.read_csv(plots.DATA / "reuse_serve.csv"), tmp_path / "r.png")
    plots.plot_budget(plots.read_csv(plots.DATA / "serve_http.csv"), tmp_path / "b.png")
    for name in ("r.png", "b.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_the_committed_csvs_name_every_server_of_the_plots():
    reuse = plots.read_csv(plots.DATA / "reuse_serve.csv")
    assert {"mlx-lm", "ours"} <= {r["server"] for r in reuse}
    budget = plots.read_csv(plots.DATA / "serve_http.csv")
    assert {"mlx-lm", "ours hot-only", "ours + SSD"} <= {r["system"] for r in budget}
    assert len({r["budget_mib"] for r in budget}) >= 2


def test_write_csv_round_trips_and_a_missing_column_is_refused(tmp_path):
    rows = [{"budget_mib": 3.0, "system": "mlx-lm", "cached_share": 0.5, "ttft_p50_ms": 40.0,
             "ttft_p90_ms": 90.0, "paired": 1.0}]  # fmt: skip
    write_csv(str(tmp_path / "x.csv"), rows)
    with open(tmp_path / "x.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [
            {"budget_mib": "3", "system": "mlx-lm", "cached_share": "0.5",
             "ttft_p50_ms": "40", "ttft_p90_ms": "90", "paired": "1"}
        ]  # fmt: skip
    plots.plot_budget(plots.read_csv(tmp_path / "x.csv"), tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG
    del rows[0]["ttft_p90_ms"]  # the control: a CSV without a column the plot reads
    write_csv(str(tmp_path / "y.csv"), rows)
    with pytest.raises(KeyError, match="ttft_p90_ms"):
        plots.plot_budget(plots.read_csv(tmp_path / "y.csv"), tmp_path / "y.png")
