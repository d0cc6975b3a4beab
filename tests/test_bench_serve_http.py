"""bench_serve_http in short: real servers through a tiny trace with its restart.

Plain mlx_lm.server and prefixcache serve with an SSD tier, up at once and
taking each request in turn (``--lockstep``), each restarted halfway: both give
the same replies and report cached tokens (read from the stream's usage); after
the restart ours restores each resumed conversation from its SSD tier, while
mlx-lm, which keeps nothing across a restart, restores only the few template
tokens the conversations share (the control: each conversation has a system
prompt of its own).
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import bench_serve_http
from benchlib import chat_model_shape
from reuselib.trace import Text
from serve_replay import lockstep

from prefixcache.tiny.models import save_model

ARGS = shlex.split(
    "--conversations 2 --turns 3 --active 2 --systems 2 --max-tokens 4 "
    "--system-words 60 --user-words 6 --hidden 64 --budget 8M --lockstep"
)


@pytest.fixture(scope="module")
def results():
    args = bench_serve_http.setup_arg_parser().parse_args(ARGS)
    trace = bench_serve_http.make_trace(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp) / "model", "llama", **chat_model_shape(args.hidden))
        systems = ("mlx-lm", "ours + SSD")
        # both servers up at once, each request to each in turn (--lockstep)
        made = [bench_serve_http.steps(x, 8 << 20, model, trace, Text(0), args) for x in systems]
        return dict(zip(systems, lockstep(made, reverse=True), strict=True))


def test_both_answer_alike_and_report_cached_tokens(results):
    plain, ours = results["mlx-lm"], results["ours + SSD"]
    assert len(plain.ttfts) == len(ours.ttfts) == 6
    assert plain.replies == ours.replies
    assert plain.prompt_tokens == ours.prompt_tokens > 0
    assert ours.cached_tokens > 0


def test_only_the_ssd_tier_survives_the_restart(results):
    plain, ours = results["mlx-lm"], results["ours + SSD"]
    assert plain.resumed_prompt == ours.resumed_prompt > 0
    # mlx-lm finds only what the conversations' chat templates share (a few tokens)
    assert plain.resumed_cached < 0.1 * plain.resumed_prompt
    assert ours.resumed_cached > 0.5 * ours.resumed_prompt


def test_the_csv_figures_are_the_printed_table_s(results, tmp_path):
    measured = bench_serve_http.measures(8 << 20, {k: [v] for k, v in results.items()})
    plain, ours = measured
    assert plain["paired"] == 1.0 and plain["same_replies"] == "ref"
    assert ours["same_replies"] is True
    got = results["ours + SSD"]
    assert ours["cached_share"] == got.cached_tokens / got.prompt_tokens
    row = bench_serve_http.table_row(ours)
    assert row["cached/prompt"].strip() == f"{ours['cached_share']:.1%}"
    assert row["paired"].strip() == f"{ours['paired']:.3f}"
    # the control: without mlx-lm there is no reference, and the ratios are left empty
    alone = bench_serve_http.measures(8 << 20, {"ours + SSD": [results["ours + SSD"]]})[0]
    assert alone["paired"] == alone["p50_ratio"] == "" and alone["same_replies"] is False
    assert bench_serve_http.table_row(alone)["paired"] == "-"
