"""TTFT saved under a device profile: prefill time of the cached tokens, less loading them."""

from __future__ import annotations

import json

import pytest

from prefixcache.cli import main
from prefixcache.traces.device import PRESETS, DeviceProfile, measure_this, ttft_saved
from prefixcache.traces.shapes import PRESETS as SHAPES

LLAMA = SHAPES["llama-3.1-8b"]


def _doc(hot_share: float) -> dict:
    return {
        "requests": 2,
        "cached_tokens": 1024,
        "prefill_flops_saved": 1e13,
        "hit_share": {"hot": hot_share, "ssd": 1 - hot_share, "remote": 0.0},
    }


def test_ttft_saved_is_prefill_time_less_load_time():
    device = DeviceProfile("d", 1e13, 4e9, 1e9)
    per_token = LLAMA.block_bytes(512) / 512  # 128 KiB
    out = ttft_saved(_doc(0.5), LLAMA, 512, device)
    load = 512 * per_token / 2e9 + 512 * per_token / 1e9
    assert out["ttft_saved_seconds"] == pytest.approx(1.0 - load)
    assert out["ttft_saved_per_request"] == pytest.approx((1.0 - load) / 2)
    # negative control: an SSD slower than recomputing makes its hits cost time
    slow = DeviceProfile("slow", 1e13, 4e9, 1e6)
    assert ttft_saved(_doc(0.0), LLAMA, 512, slow)["ttft_saved_seconds"] < 0
    assert (
        ttft_saved({"prefill_flops_saved": None}, LLAMA, 512, device)["ttft_saved_seconds"] is None
    )


def test_presets_and_this_machine(tmp_path):
    assert PRESETS["m2-ultra"].prefill_flops_per_s > PRESETS["m1-max"].prefill_flops_per_s
    here = measure_this(str(tmp_path), nbytes=8 << 20)
    assert here.prefill_flops_per_s > 0 and here.memory_bytes_per_s > 0
    assert here.ssd_bytes_per_s > 0 and not list(tmp_path.iterdir())  # its file removed


def test_simulate_reports_ttft_saved(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": t, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
        for t in range(3)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["simulate", str(path), "--hot", "1G", "--device", "m2-ultra", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "m2-ultra" and doc["ttft_saved_seconds"] > 0
    assert main(["simulate", str(path), "--hot", "1G", "--device", "m9"]) == 2
    assert "unknown device 'm9'" in capsys.readouterr().err
