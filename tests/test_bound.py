"""prefixcache/traces/bound.py: the byte-time bound on any one-tier policy.

Hand-worked traces give its exact value (a budget one byte short of a hit's
bytes buys less than the hit: the control); on random conversations it is
at or above the exact optimum of K/V blocks (attention) and at or above
every policy the simulator runs on the hybrid, close to the optimum where
the optimum is known, and it grows with the budget.
"""

from __future__ import annotations

import json
import random

import pytest

from prefixcache.cli import main
from prefixcache.traces.bound import bound_hit_rates
from prefixcache.traces.optimum import optimum_hit_rates
from prefixcache.traces.reader import TraceRequest
from prefixcache.traces.shapes import PRESETS
from prefixcache.traces.simulator import SimConfig, Simulation

LLAMA, HYBRID = PRESETS["llama-3.1-8b"], PRESETS["qwen3-next-80b-a3b"]
KV = LLAMA.block_bytes(512)


def _request(i: int, ids: list[int], short: int = 0) -> TraceRequest:
    return TraceRequest(i * 1000, 512 * len(ids) - short, 1, tuple(ids))


def test_a_hand_worked_reuse_gives_its_exact_bound() -> None:
    trace = [_request(0, [1, 2]), _request(1, [1, 2, 3])]  # the last half: the second
    assert bound_hit_rates(trace, LLAMA, 2 * KV)[1] == pytest.approx(1024 / 1536)
    assert bound_hit_rates(trace, LLAMA, KV)[1] == pytest.approx(512 / 1536)
    # control: a byte short of one block buys that share of its tokens, not the block
    assert bound_hit_rates(trace, LLAMA, KV - 1)[1] < 512 / 1536


def test_a_hybrid_hit_needs_the_state_at_the_block_it_resumes_from() -> None:
    kv, state = HYBRID.block_bytes(512), HYBRID.checkpoint_bytes
    trace = [_request(0, [1, 2]), _request(1, [1, 2, 3])]  # a state is made at block 2
    assert bound_hit_rates(trace, HYBRID, 2 * kv + state)[1] == pytest.approx(1024 / 1536)
    assert bound_hit_rates(trace, HYBRID, 2 * kv + state - 1)[1] < 1024 / 1536
    # no state at block 1 (no prompt ended there): its K/V alone resumes nothing
    share = kv / (2 * kv + state)  # a fraction of the one hit, in the linear relaxation
    assert bound_hit_rates(trace, HYBRID, kv)[1] == pytest.approx(share * 1024 / 1536)
    # a short last block keeps no state: the state is at the last full block, as simulated
    short = [_request(0, [1, 2], short=100), _request(1, [1, 2, 3])]
    simulated = Simulation(SimConfig(HYBRID, 1 << 40)).run(short).as_json()
    assert bound_hit_rates(short, HYBRID, 1 << 40)[1] == pytest.approx(512 / 1536)
    assert simulated["hit_rate_last_half"] == pytest.approx(512 / 1536)


def test_a_prompt_ending_at_a_block_held_keeps_its_state_in_the_simulator() -> None:
    trace = [_request(0, [1, 2, 3]), _request(1, [1, 2]), _request(2, [1, 2, 4])]
    simulated = Simulation(SimConfig(HYBRID, 1 << 40)).run(trace).as_json()
    every = bound_hit_rates(trace, HYBRID, 1 << 40)[1]
    new = bound_hit_rates(trace, HYBRID, 1 << 40, states="new")[1]
    # [1, 2] was held without a state at 2: its capture upgrades it, [1, 2, 4] resumes there
    assert simulated["hit_rate_last_half"] == pytest.approx(every)
    assert every == pytest.approx(1024 / (1024 + 1536))
    assert new == 0.0  # control: states only where the last full block is new
    with pytest.raises(ValueError, match="'all'"):
        bound_hit_rates(trace, HYBRID, 1 << 40, states="all")


def _conversations(seed: int, n: int = 400) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, live, fresh = [], [], 1000
    for i in range(n):
        ids = live.pop(rng.randrange(len(live))) if live and rng.random() < 0.6 else [0]
        ids = [*ids, *range(fresh, fresh + rng.randint(1, 4))]
        fresh += 4
        if rng.random() < 0.7:
            live.append(ids)
        out.append(_request(i, ids, short=rng.choice((0, 0, 200))))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bound_is_above_the_optimum_and_near_it(seed: int) -> None:
    trace = _conversations(seed)
    rates = []
    for blocks in (8, 32, 128):
        optimum = optimum_hit_rates(trace, blocks)[1]
        bound = bound_hit_rates(trace, LLAMA, blocks * KV)[1]
        assert optimum - 1e-9 <= bound <= optimum + 0.1  # sound, and not loose by much
        rates.append(bound)
    assert rates == sorted(rates) and rates[0] < rates[-1]


def test_no_policy_the_simulator_runs_beats_the_hybrid_bound() -> None:
    trace = _conversations(2)
    per_block = HYBRID.block_bytes(512) + HYBRID.checkpoint_bytes
    for budget in (4 * per_block, 16 * per_block, 64 * per_block):
        bound = bound_hit_rates(trace, HYBRID, budget)
        for policy in ("lru", "cost", "adaptive"):
            got = Simulation(SimConfig(HYBRID, budget, eviction=policy)).run(trace).as_json()
            assert got["hit_rate"] <= bound[0] + 1e-9
            assert got["hit_rate_last_half"] <= bound[1] + 1e-9


def test_simulate_runs_the_bound_on_a_hot_tier_alone(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for r in _conversations(3, 60):
            doc = {"timestamp": r.timestamp_ms, "input_length": r.input_length}
            f.write(json.dumps(doc | {"output_length": 1, "hash_ids": list(r.hash_ids)}) + "\n")
    args = ["simulate", str(path), "--shape", "qwen3-next-80b-a3b", "--hot", "1G"]
    assert main([*args, "--eviction", "lru,bound", "--json"]) == 0
    lru, bound = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert bound["eviction"] == "bound" and bound["hit_rate_last_half"] >= lru["hit_rate_last_half"]
    assert main([*args, "--ssd", "1G", "--eviction", "bound"]) == 2
    assert "--eviction bound: a hot tier alone" in capsys.readouterr().err
