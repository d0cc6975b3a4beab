"""``prefixcache replay``: a small trace through the tiny llama, PrefixCache and mlx-lm's
LRUPromptCache, with the cached tokens of every request known in advance."""

from __future__ import annotations

import json
import sys

import pytest
from test_serve_e2e import running

from prefixcache.cli import main
from prefixcache.tiny.models import save_model
from prefixcache.traces.reader import read_trace
from prefixcache.traces.replay import LibrarySystem, MlxLruSystem, ReplayConfig, replay
from prefixcache.traces.shapes import shape_from_config
from prefixcache.traces.simulator import SimConfig, Simulation

BLOCK = 4  # tokens per hash id, written in the trace: no scaling
# (hash ids, input length): a cold prompt; a sibling sharing two blocks; the first
# again (a full hit: all but the last token); an unrelated prompt; the sibling grown
TRACE = [([1, 2, 3], 10), ([1, 2, 4], 12), ([1, 2, 3], 10), ([5], 3), ([1, 2, 4, 6], 13)]
EXPECTED = [0, 8, 9, 0, 12]


def _write(path, trace) -> str:
    with open(path, "w") as f:
        for t, (ids, n) in enumerate(trace):
            line = {"timestamp": 1000 * t, "input_length": n, "output_length": 3}
            f.write(json.dumps(line | {"hash_ids": ids, "block_tokens": BLOCK}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("replay") / "llama", "llama")


def _shape(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    return shape_from_config(config, "tiny").with_kv_bits(32)  # the tiny model runs in float32


def _run(llama, trace_path, system_name, hot_bytes, model_dir):
    requests = read_trace(trace_path)
    config = ReplayConfig(hot_bytes, block_tokens=BLOCK, eviction="lru")
    if system_name == "prefixcache":
        system = LibrarySystem(llama, config, model_id="test-replay")
    else:
        system = MlxLruSystem(llama, hot_bytes)
    return replay(requests, llama, system, config, _shape(model_dir))


@pytest.mark.parametrize("system", ["prefixcache", "mlx-lm"])
def test_replay_counts_exactly_the_shared_blocks(tmp_path, llama, model_dir, system):
    out = _run(llama, _write(tmp_path / "t.jsonl", TRACE), system, 1 << 20, model_dir)
    assert out.num_cached == EXPECTED
    doc = out.as_json()
    assert doc["prompt_tokens"] == 48 and doc["cached_tokens"] == sum(EXPECTED)
    assert doc["hit_rate_last_half"] == pytest.approx(21 / 26)  # requests 3-5 (of 5)
    assert len(out.ttfts) == 5 and 0 < doc["ttft_p50"] <= doc["ttft_p90"] <= doc["ttft_p99"]
    # negative control: the sibling's second id changed: it shares the root block only,
    # and the last request shares two blocks with the first
    other = [*TRACE[:1], ([1, 7, 4], 12), *TRACE[2:]]
    out = _run(llama, _write(tmp_path / "u.jsonl", other), system, 1 << 20, model_dir)
    assert out.num_cached == [0, 4, 9, 0, 8]


def test_replay_budget_evicts_and_simulate_agrees(tmp_path, llama, model_dir):
    """Room for three blocks of K/V: the library keeps what simulate keeps."""
    shape = _shape(model_dir)
    block = shape.block_bytes(BLOCK)  # 2 layers x K/V x 2 heads x 16 x 4 tokens x 4 bytes
    assert block == 2048
    path = _write(tmp_path / "t.jsonl", TRACE)
    out = _run(llama, path, "prefixcache", 3 * block, model_dir)
    sim = Simulation(SimConfig(shape, 3 * block, eviction="lru", block_tokens=BLOCK))
    counted = sim.run(read_trace(path))
    assert out.num_cached != EXPECTED and out.counts.peak_bytes["hot"] <= 3 * block
    # simulate counts a full hit's last token too (1 token more on request 3)
    assert abs(counted.cached_tokens - out.counts.cached_tokens) <= 1


def test_replay_cli_reports_both_systems_and_simulate(tmp_path, model_dir, capsys):
    path = _write(tmp_path / "t.jsonl", TRACE)
    argv = ["replay", path, "--model", str(model_dir), "--hot", "1M", "--json"]
    assert main([*argv, "--block-tokens", str(BLOCK), "--eviction", "lru"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["system"] for d in docs] == ["prefixcache", "mlx-lm", "simulate"]
    assert [d["cached_tokens"] for d in docs] == [29, 29, 30]
    for key in ("hit_rate", "hit_share", "peak_bytes", "ssd_bytes_written", "ttft_p90"):
        assert key in docs[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--hot", "1M", "--block-tokens", "0"], "--block-tokens must be >= 1, got 0"),
        (["--hot", "1M", "--systems", "vllm"], "'vllm' is not one of"),
        ([], "--hot: library mode needs a RAM budget"),
        (["--hot", "1M", "--speed", "0"], "--speed must be a positive number"),
    ],
)
def test_replay_bad_input_is_one_line(tmp_path, model_dir, capsys, extra, message):
    path = _write(tmp_path / "t.jsonl", TRACE)
    assert main(["replay", path, "--model", str(model_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_replay_bad_trace_and_model_are_one_line(tmp_path, model_dir, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(_write_line([1, 2], 5) + '{"timestamp": 1, "input_length": 5}\n')
    assert main(["replay", str(path), "--model", str(model_dir), "--hot", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: missing field" in err
    assert main(["replay", str(path), "--model", str(tmp_path / "none"), "--hot", "1M"]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    path.write_text(_write_line([1, 2], 5).replace('"block_tokens": 4', '"block_tokens": 0'))
    assert main(["replay", str(path), "--model", str(model_dir), "--hot", "1M"]) == 2
    assert "line 1: block_tokens must be an integer >= 1, got 0" in capsys.readouterr().err


def _write_line(ids: list[int], n: int) -> str:
    line = {"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": ids}
    return json.dumps(line | {"block_tokens": BLOCK}) + "\n"


def test_replay_through_a_server_counts_what_it_reports(tmp_path, model_dir, capsys):
    """``--url``: the same trace sent as text the server tokenizes back to the trace's
    tokens; requests 1.5 s apart at ``--speed 2`` come one at a time (exact counts)."""
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for t, (ids, n) in enumerate(TRACE):
            line = {"timestamp": 3000 * t, "input_length": n, "output_length": 3}
            f.write(json.dumps(line | {"hash_ids": ids, "block_tokens": BLOCK}) + "\n")
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model_dir)]
    argv += ["--hot-cache-only", "--block-size", str(BLOCK)]
    with running(argv, tmp_path / "serve.log") as server:
        replay = ["replay", str(path), "--model", str(model_dir), "--url", server.url]
        assert main([*replay, "--block-tokens", str(BLOCK), "--speed", "2", "--json"]) == 0
    (doc,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert doc["system"] == server.url and doc["requests"] == 5
    assert doc["prompt_tokens"] == 48 and doc["cached_tokens"] == sum(EXPECTED)
    assert 0 < doc["ttft_p50"] <= doc["ttft_p90"]
    # negative control: nothing listens there any more
    assert main([*replay, "--block-tokens", str(BLOCK)]) == 2
    assert f"--url '{server.url}'" in capsys.readouterr().err
