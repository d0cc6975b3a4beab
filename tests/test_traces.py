"""Traces: the Mooncake reader's errors, ``prefixcache simulate``, the optimum, density eviction."""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict

import pytest

from prefixcache.cli import main, replay
from prefixcache.config import CacheConfig
from prefixcache.tiers.hot.frequency import FrequencyPolicy
from prefixcache.traces.optimum import optimum_hit_rates
from prefixcache.traces.reader import TraceError, TraceRequest, read_trace, request_tokens
from prefixcache.traces.replay import ReplayConfig
from prefixcache.traces.shapes import PRESETS
from prefixcache.traces.simulator import SimConfig, Simulation

LLAMA = PRESETS["llama-3.1-8b"]
BLOCK = LLAMA.block_bytes(512)  # 64 MiB


def _write(path, requests) -> str:
    with open(path, "w") as f:
        for t, ids in requests:
            f.write(
                json.dumps(
                    {
                        "timestamp": t,
                        "input_length": 512 * len(ids),
                        "output_length": 1,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    return str(path)


def _random_trace(seed: int, n: int = 400) -> list[tuple[int, list[int]]]:
    """Chains drawn from a small tree: shared roots, conversations that grow."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    out, next_id = [], 100
    for t in range(n):
        if convs and rng.random() < 0.6:
            chain = rng.choice(convs)
            if len(chain) < 5:
                chain.append(next_id)
                next_id += 1
        else:
            chain = [rng.randrange(3), next_id]
            next_id += 1
            convs.append(chain)
        out.append((t * 1000, list(chain)))
    return out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not JSON"),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1}',
            "line 2: missing field 'hash_ids'",
        ),
        (
            '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}',
            "input_length",
        ),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ("[1, 2]", "line 2: not a JSON object"),
    ],
)
def test_reader_names_the_bad_line(tmp_path, line, message, capsys):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)
    assert main(["simulate", str(path), "--hot", "1G"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.split(": ")[-1] in err and "Traceback" not in err


def test_reader_reads_and_makes_tokens(tmp_path):
    path = _write(tmp_path / "t.jsonl", [(0, [7, 8]), (5, [7, 9])])
    a, b = read_trace(path)
    assert a == TraceRequest(0, 1024, 1, (7, 8))
    ta = request_tokens(a, block_tokens=16, vocab_size=100)
    tb = request_tokens(b, block_tokens=16, vocab_size=100)
    assert len(ta) == 32 and ta[:16] == tb[:16] and ta[16:] != tb[16:]  # same id, same tokens
    short = TraceRequest(0, 600, 1, (7, 8))
    assert short.block_tokens() == [512, 88] and short.block_tokens(16) == [16, 3]
    assert request_tokens(short, block_tokens=16, vocab_size=100) == ta[:19]


def test_simulate_json_keys(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", _random_trace(0, 60))
    assert main(["simulate", path, "--hot", "256M", "--ssd", "1G", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_rate",
        "hit_rate_last_half",
        "hit_share",
        "ssd_bytes_written",
        "ssd_bytes_written_per_day",
        "peak_bytes",
        "prefill_flops_saved",
        "seconds",
    ):
        assert key in doc
    assert doc["requests"] == 60 and doc["peak_bytes"]["hot"] <= 256 << 20
    assert doc["hit_share"]["ssd"] > 0 and doc["ssd_bytes_written"] > 0
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", path, "--hot", "12Q"])
    assert exit_info.value.code == 2
    assert "not a byte size: '12Q'" in capsys.readouterr().err


def test_simulate_sweep_writes_csv_and_plot(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", _random_trace(0, 80))
    out = tmp_path / "sweep"
    args = ["simulate", path, "--hot", "1G", "--eviction", "lru,optimal"]
    assert main([*args, "--sweep", "hot=256M,512M", "--out", str(out), "--json"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["eviction"] for d in docs] == ["lru", "lru", "optimal", "optimal", "ceiling"]
    assert all(d["hit_rate"] <= docs[-1]["hit_rate"] + 1e-9 for d in docs)
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 6
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*args, "--eviction", "mru"]) == 2  # not a policy: one line, exit 2


def test_simulate_defaults_to_the_library_eviction(tmp_path, capsys):
    """Without ``--eviction``, simulate sizes the policy a server runs: CacheConfig's."""
    path = _write(tmp_path / "t.jsonl", _scan_trace())

    def point(*flags: str) -> dict:
        assert main(["simulate", path, "--hot", "1G", "--json", *flags]) == 0
        doc = json.loads(capsys.readouterr().out)
        del doc["seconds"]
        return doc

    default = point()
    assert default["eviction"] == CacheConfig().eviction == "adaptive"
    assert default == point("--eviction", "adaptive")
    # control: LRU, the former default, keeps other blocks on this trace (16 blocks)
    lru = point("--eviction", "lru")
    assert lru["cached_tokens"] != default["cached_tokens"]


def test_replay_defaults_to_the_library_eviction():
    parser = argparse.ArgumentParser()
    replay.add_args(parser)
    args = parser.parse_args(["t.jsonl", "--model", "m"])
    assert args.eviction == CacheConfig().eviction == ReplayConfig(1).eviction
    assert parser.parse_args(["t", "--model", "m", "--eviction", "lru"]).eviction == "lru"


def _plain_lru(trace, capacity: int) -> int:
    """Cached tokens of a plain LRU of chain prefixes: evict the least recent leaf,
    never the block just stored; hits touched deepest first, as the hot tier does."""
    lru: OrderedDict[tuple, None] = OrderedDict()
    cached = 0
    for _, ids in trace:
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hit = 0
        while hit < len(keys) and keys[hit] in lru:
            hit += 1
        cached += 512 * hit
        for key in reversed(keys[:hit]):
            lru.move_to_end(key)
        for key in keys[hit:]:
            lru[key] = None
            while len(lru) > capacity:
                victim = next(k for k in lru if k != key and not any(c[:-1] == k for c in lru))
                del lru[victim]
    return cached


@pytest.mark.parametrize("seed", [0, 1])
def test_simulate_agrees_with_a_plain_lru(tmp_path, seed):
    trace = _random_trace(seed)
    requests = read_trace(_write(tmp_path / "t.jsonl", trace))
    for capacity in (6, 12):
        config = SimConfig(LLAMA, capacity * BLOCK, eviction="lru")
        got = Simulation(config).run(requests).cached_tokens
        assert got == _plain_lru(trace, capacity)
    # negative control: a cache one block larger hits differently
    assert _plain_lru(trace, 13) != _plain_lru(trace, 12)


def test_no_policy_beats_the_optimum(tmp_path):
    requests = read_trace(_write(tmp_path / "t.jsonl", _random_trace(3)))
    for capacity in (4, 8, 16):
        best = optimum_hit_rates(requests, capacity)[0]
        for eviction in ("lru", "cost", "density"):
            sim = Simulation(SimConfig(LLAMA, capacity * BLOCK, eviction=eviction)).run(requests)
            assert sim.as_json()["hit_rate"] <= best + 1e-9
    # negative control: the optimum does better than LRU somewhere
    config = SimConfig(LLAMA, 8 * BLOCK, eviction="lru")
    lru = Simulation(config).run(requests).as_json()["hit_rate"]
    assert optimum_hit_rates(requests, 8)[0] > lru


def _scan_trace() -> list[tuple[int, list[int]]]:
    """A popular 3-block chain every third request, one-off 6-block chains between."""
    out, next_id = [], 1000
    for t in range(900):
        if t % 3 == 0:
            out.append((t, [1, 2, 3]))
        else:
            out.append((t, list(range(next_id, next_id + 6))))
            next_id += 6
    return out


def test_density_keeps_what_is_reused_through_a_scan(tmp_path):
    requests = read_trace(_write(tmp_path / "t.jsonl", _scan_trace()))
    config = SimConfig(LLAMA, 8 * BLOCK, eviction="lru")
    lru = Simulation(config).run(requests).as_json()["hit_rate_last_half"]
    sim = Simulation(replace_eviction(config, "density"))
    density = sim.run(requests).as_json()["hit_rate_last_half"]
    assert lru == 0.0  # negative control: the scan flushes the popular chain from an LRU
    assert density > 0.1  # at most 0.2: the popular chain's 3 of the 15 blocks of 3 requests
    assert sim.hot.eviction.num_refused > 0  # one-off blocks were not admitted


def replace_eviction(config: SimConfig, eviction: str, **changes: object) -> SimConfig:
    from dataclasses import replace

    return replace(config, eviction=eviction, **changes)


def test_frequency_keeps_what_is_reused_through_a_scan(tmp_path):
    requests = read_trace(_write(tmp_path / "t.jsonl", _scan_trace()))
    config = SimConfig(LLAMA, 8 * BLOCK, eviction="lru")
    sim = Simulation(replace_eviction(config, "frequency"))
    frequency = sim.run(requests).as_json()["hit_rate_last_half"]
    lru = Simulation(config).run(requests).as_json()["hit_rate_last_half"]
    assert lru == 0.0  # negative control: the scan flushes the popular chain from an LRU
    assert frequency == pytest.approx(0.2)  # every popular request hits its 3 blocks
    assert sim.hot.eviction.num_refused > 0


def _aging_trace() -> list[tuple[int, list[int]]]:
    """Chain A popular early, then chain B popular: aging must let B in."""
    out = []
    for t in range(300):
        out.append((t, [1, 2, 3]))
    for t in range(300, 900):
        out.append((t, [7, 8, 9] if t % 2 else [10 + t, 11 + t, 12 + t]))
    return out


def test_frequency_ages_out_old_popularity(tmp_path):
    requests = read_trace(_write(tmp_path / "t.jsonl", _aging_trace()))
    sim = Simulation(SimConfig(LLAMA, 4 * BLOCK, eviction="frequency"))
    rate = sim.run(requests).as_json()["hit_rate_last_half"]
    # B's blocks displace A's once the floor passes A's old counts: most B requests hit
    assert rate > 0.4  # at most 0.5: B's 3 blocks in every other request
    # negative control: without the aging floor (plain LFU) A holds the cache until B's
    # count passes A's, late in the second half
    sim = Simulation(SimConfig(LLAMA, 4 * BLOCK, eviction="frequency"))
    hot = sim.hot
    hot.eviction.frequency = _NoAging(4, hot._lru, hot._children)
    assert sim.run(requests).as_json()["hit_rate_last_half"] < rate - 0.2


class _NoAging(FrequencyPolicy):
    """Frequency eviction whose floor never rises: plain LFU with admission."""

    def evicted(self, priority: float) -> None:
        pass


def test_hybrid_resumes_only_at_a_checkpoint(tmp_path):
    trace = [(0, [1, 2, 3]), (1, [1, 2, 4]), (2, [1, 2, 3, 5])]
    requests = read_trace(_write(tmp_path / "t.jsonl", trace))
    hybrid = Simulation(SimConfig(PRESETS["qwen3-next-80b-a3b"], 1 << 40)).run(requests)
    plain = Simulation(SimConfig(LLAMA, 1 << 40)).run(requests)
    # the first request kept its state at its end (block 3) only: the second resumes
    # nowhere, the third at block 3
    assert hybrid.cached_tokens == 3 * 512
    assert plain.cached_tokens == (2 + 3) * 512  # negative control: K/V alone cuts anywhere


def test_hybrid_prompt_ending_at_a_held_block_keeps_its_state(tmp_path):
    """A prompt ending at a block held without its state (the first request kept
    state at block 3 only) stores the state there, as the library's capture
    upgrades a hot block: the third and fourth requests resume at block 2, the
    second (the upgrade's own) nowhere."""
    trace = [(0, [1, 2, 3]), (1, [1, 2]), (2, [1, 2]), (3, [1, 2, 9, 4])]
    requests = read_trace(_write(tmp_path / "t.jsonl", trace))
    sim = Simulation(SimConfig(PRESETS["qwen3-next-80b-a3b"], 1 << 40))
    cached = []
    for request in requests:
        before = sim.result.cached_tokens
        sim.step(request, measured=True)
        cached.append(sim.result.cached_tokens - before)
    assert cached == [0, 0, 2 * 512, 2 * 512]
    assert (
        sim.hot.get(sim.chain(requests[1])[0][-1].key).nbytes
        > sim._kv[sim.chain(requests[1])[0][-1].key]
    )


def test_ssd_admission_keeps_one_offs_off_the_ssd(tmp_path):
    # one conversation growing turn by turn, interleaved with one-off prompts that
    # push it out of a hot tier of 4 blocks
    trace, turn = [], [1]
    for t in range(40):
        turn = [*turn, 100 + t]
        trace.append((2 * t, list(turn)))
        trace.append((2 * t + 1, [5000 + 3 * t, 5001 + 3 * t, 5002 + 3 * t]))
    requests = read_trace(_write(tmp_path / "t.jsonl", trace))
    config = SimConfig(LLAMA, 4 * BLOCK, 1 << 40, eviction="lru", ssd_admit_after=1)
    once = Simulation(config).run(requests)
    twice = Simulation(replace_eviction(config, "lru", ssd_admit_after=2)).run(requests)
    assert twice.ssd_bytes_written < once.ssd_bytes_written / 2  # one-offs stay off the SSD
    assert twice.hit_tokens["ssd"] > 0.9 * once.hit_tokens["ssd"]  # the conversation does not


def test_hybrid_next_turn_resumes_at_the_last_full_block(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [  # a 2.5-block prompt, then its next turn: the short block changed id
        {"timestamp": 0, "input_length": 1280, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 4, 5]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sim = Simulation(SimConfig(PRESETS["qwen3-next-80b-a3b"], 1 << 40)).run(read_trace(path))
    assert sim.cached_tokens == 2 * 512  # state kept at block 2, the last full one
