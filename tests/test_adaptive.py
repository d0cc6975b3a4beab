"""Adaptive eviction and SSD admission by reach: the reach measured, the regime picked,
what admission keeps."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.stats import Stats
from prefixcache.tiers.governor import WriteGovernor
from prefixcache.tiers.hot.adaptive import AdaptivePolicy, sampled
from prefixcache.tiers.hot.reach import Reach
from prefixcache.tiers.hot.tier import HotTier
from prefixcache.tiers.pins import Pins
from prefixcache.traces.reader import read_trace
from prefixcache.traces.shapes import PRESETS
from prefixcache.traces.simulator import SimConfig, Simulation

LLAMA = PRESETS["llama-3.1-8b"]
BLOCK = LLAMA.block_bytes(512)
ROOT = b"r" * 16


def _reach_of(near: int, far: int, capacity: int) -> Reach:
    """A reach fed ``near`` first reuses at distance 5 and ``far`` at distance 50."""
    reach = Reach(decide_after=near + far)
    key = 0
    for distance, count in ((5, near), (50, far)):
        for _ in range(count):
            reach.first_seen(("k", key), capacity)
            for i in range(distance):  # new blocks in between
                reach.first_seen(("filler", key, i), capacity)
            reach.seen_again(("k", key), capacity)
            key += 1
    return reach


def test_reach_is_the_share_of_first_reuses_within_a_capacity():
    assert _reach_of(30, 70, capacity=10).share == pytest.approx(0.3)
    assert _reach_of(30, 70, capacity=60).share == pytest.approx(1.0)  # control: all within
    # a reuse past the window (horizon x capacity new blocks) is not counted at all
    assert _reach_of(30, 70, capacity=5).share is None  # 50 > 8 x 5: only 30 of 100 seen


def test_reach_is_unknown_until_enough_reuses():
    reach = _reach_of(3, 3, capacity=10)
    assert reach.share == pytest.approx(0.5)
    assert Reach(decide_after=7).share is None
    short = Reach(decide_after=7)
    short.seen_again("never seen", 10)  # not in the window: no reuse counted
    assert short.far == 0


@pytest.mark.parametrize(
    ("share", "regime"),
    [(None, "recent"), (0.05, "keep"), (0.3, "sample"), (0.7, "full"), (0.95, "lru")],
)
def test_regime_follows_the_reach(share, regime):
    policy = AdaptivePolicy(8, {}, {})
    policy.reach.share = share
    assert policy.regime == regime


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match=r"capacity.*\b0"):
        AdaptivePolicy(0, {}, {})
    with pytest.raises(ValueError, match=r"sample.*1\.5"):
        AdaptivePolicy(8, {}, {}, sample=1.5)
    with pytest.raises(ValueError, match=r"sample.*0\.0"):
        AdaptivePolicy(8, {}, {}, sample=0.0)
    with pytest.raises(ValueError, match=r"horizon.*\b1"):
        Reach(horizon=1)
    with pytest.raises(ValueError, match=r"decide_after.*\b0"):
        Reach(decide_after=0)


def _held_in(hot: HotTier, share: float | None, **kw) -> AdaptivePolicy:
    """``hot``'s adaptive policy held at reach ``share`` (None: not known yet)."""
    reach = Reach(decide_after=1 << 30)
    reach.share = share
    hot.eviction.adaptive = AdaptivePolicy(8, hot._lru, hot._children, reach=reach, **kw)
    return hot.eviction.adaptive


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


@pytest.mark.parametrize(
    ("share", "weighed", "first_out"),
    [(None, True, "cheap"), (None, False, "deep"), (0.95, True, "deep")],
)
def test_a_costlier_block_outlives_an_older_cheap_one_until_the_reach_is_known(
    share, weighed, first_out
):
    """Until the reach is known the order is cost's (credit.py): a deep block
    (ten times the recompute FLOPs) stored first goes after a shallow one stored
    after it. Controls: without the cost hook, and at a reach of 0.9 or more
    (``lru``), the older one goes first."""
    cost = (lambda b: 1.0 + 9 * (b.index > 0)) if weighed else None
    hot = HotTier(6 * 64, policy="adaptive", cost=cost)
    _held_in(hot, share)
    names = ["s0", "s1", "s2", "s3", "deep", "cheap"] + [f"n{i}" for i in range(5)]
    for name in names:
        hot.put(_block(name, _key("x"), 40) if name == "deep" else _block(name))
    assert len(hot) == 6 and not any(_key(f"s{i}") in hot for i in range(4))
    kept = {"deep", "cheap"} - {first_out}
    assert _key(first_out) not in hot and _key(kept.pop()) in hot


def _lean(block: Block) -> Block | None:
    """A hybrid block without its state: 16 of its 64 bytes."""
    return (
        None
        if block.nbytes == 16
        else Block(block.key, block.parent, ROOT, block.index, b"", {}, 16)
    )


def _used_chain_end(hot: HotTier, uses: int) -> Block:
    a = _block("a")
    hot.put(a)
    for _ in range(uses - 1):
        hot.touch([a.key])
    hot.put(_block("b", a.key, 1))
    return a


def test_a_hybrid_chain_end_takes_its_chain_count():
    hot = HotTier(64 * 4, shed=_lean, policy="adaptive")
    _held_in(hot, 0.7, states=hot.eviction.states)
    _used_chain_end(hot, 6)
    assert hot.eviction.adaptive.frequency.uses[_key("b")] == 4  # its parent's, up to 4
    # control: an attention model's tier (no state to shed) counts b's own sighting
    other = HotTier(64 * 4, policy="adaptive")
    _held_in(other, 0.7, states=other.eviction.states)
    _used_chain_end(other, 6)
    assert other.eviction.adaptive.frequency.uses[_key("b")] == 1


@pytest.mark.parametrize("shed", [True, False])
def test_a_leaf_that_resumes_nothing_goes_first(shed):
    """Once its state is shed and its child gone, a block resumes nothing: it goes
    before a newer leaf of lower count. Control: with its state kept (no shed hook)
    its count keeps it and the newer leaf goes."""
    hot = HotTier(64 * 3 + 16, shed=_lean if shed else None, policy="adaptive")
    _held_in(hot, 0.7, states=hot.eviction.states)
    a = _used_chain_end(hot, 6)
    hot.put(_block("c"))
    hot.put(_block("d"))  # over budget: a's state (inside a chain) is shed first
    assert hot.num_shed == int(shed) and len(hot) == 3 + int(shed)
    hot.remove([_key("b")])
    assert hot.eviction.victim() == (a.key if shed else _key("c"))


def test_the_sample_is_fixed_per_key_and_near_its_share():
    keys = [i.to_bytes(16, "little") for i in range(20_000)]
    inside = [sampled(k, 0.1) for k in keys]
    assert 0.08 < sum(inside) / len(keys) < 0.12
    assert inside == [sampled(k, 0.1) for k in keys]  # the same keys every time
    assert all(sampled(k, 1.0) for k in keys[:100])


def _block(name: str, parent: bytes = ROOT, index: int = 0) -> Block:
    return Block(name.encode().ljust(16, b"."), parent, ROOT, index, b"", {}, 64)


def _sampling_tier(capacity: int, sample: float = 1e-9) -> HotTier:
    """A hot tier whose adaptive policy is held in the ``sample`` regime."""
    hot = HotTier(capacity * 64, policy="adaptive")
    reach = Reach(decide_after=1 << 30)
    reach.share = 0.3
    hot.eviction.adaptive = AdaptivePolicy(
        capacity, hot._lru, hot._children, sample=sample, reach=reach
    )
    return hot


def test_a_full_tier_admits_a_chain_from_its_root_and_refuses_a_new_branch():
    hot = _sampling_tier(4)
    system = [_block("s0"), _block("s1", b"s0".ljust(16, b"."), 1)]
    for b in [*system, _block("a", system[-1].key, 2), _block("t0")]:
        assert hot.put(b)  # room left: everything comes in
    # full now: the end of a held chain going on, and a chain's first block, come in
    assert hot.put(_block("a2", b"a".ljust(16, b"."), 3))
    assert hot.put(_block("t1"))
    assert hot.eviction.adaptive.regime == "sample"
    # a second branch under the system prompt, seen for the first time, does not
    branch = _block("b", system[-1].key, 2)
    assert not hot.put(branch)
    assert not hot.put(_block("b2", branch.key, 3))  # nor the rest of its chain
    assert hot.eviction.num_refused == 2
    assert hot.put(branch)  # its second sighting: reused, it comes in
    hot.pins.add([_block("c").key], until=float("inf"))
    assert hot.put(_block("c", system[-1].key, 2))  # a pinned branch comes in
    assert all(k in hot for k in (system[0].key, system[1].key))


def test_every_newcomer_comes_in_while_the_reach_is_unknown():
    hot = HotTier(3 * 64, policy="adaptive")
    for i in range(10):
        assert hot.put(_block(f"n{i}", b"s0".ljust(16, b"."), 1))
    assert hot.eviction.adaptive.regime == "recent"
    assert hot.eviction.num_refused == 0 and len(hot) == 3


def _write(path, requests) -> str:
    with open(path, "w") as f:
        for t, ids in requests:
            doc = {"timestamp": t, "input_length": 512 * len(ids), "output_length": 1}
            f.write(json.dumps(doc | {"hash_ids": ids}) + "\n")
    return str(path)


def _flood_trace() -> list[tuple[int, list[int]]]:
    """A 4-block conversation every fourth request, one-off chains between, all under
    one shared first block."""
    out, fresh = [], 1000
    for t in range(600):
        if t % 4 == 0:
            out.append((t, [0, 1, 2, 3]))
        else:
            out.append((t, [0, fresh, fresh + 1, fresh + 2]))
            fresh += 3
    return out


def _run(requests, eviction: str, capacity: int, fixed_share: float | None = None) -> Simulation:
    sim = Simulation(SimConfig(LLAMA, capacity * BLOCK, eviction=eviction))
    if fixed_share is not None:
        reach = Reach(decide_after=1 << 30)
        reach.share = fixed_share
        hot = sim.hot
        hot.eviction.adaptive = AdaptivePolicy(
            capacity, hot._lru, hot._children, sample=0.05, reach=reach
        )
    sim.run(requests)
    return sim


def test_sampled_admission_keeps_a_conversation_a_flood_evicts_under_lru(tmp_path):
    requests = read_trace(_write(tmp_path / "t.jsonl", _flood_trace()))
    lru = _run(requests, "lru", 8).result
    kept = _run(requests, "adaptive", 8, fixed_share=0.3)
    # the conversation finds its 3 blocks past the shared one (nearly) every time
    turns = sum(1 for r in requests[len(requests) // 2 :] if r.hash_ids[1] == 1)
    conversation = kept.result.last_half_cached - lru.last_half_cached
    assert conversation >= 0.95 * turns * 3 * 512
    assert kept.hot.eviction.num_refused > 100  # the one-off chains stayed out
    # negative control: under LRU the one-off chains push the conversation out, and
    # every request finds only the shared first block
    assert lru.last_half_cached == 512 * (len(requests) - len(requests) // 2)


def test_large_cache_degenerates_to_lru(tmp_path):
    """A cache that reaches every reuse admits everything; a hot set bigger than it
    then ranks by counts, close to LRU on this traffic."""
    requests = read_trace(_write(tmp_path / "t.jsonl", _flood_trace()))
    big = _run(requests, "adaptive", 4000)
    assert big.hot.eviction.num_refused == 0
    assert big.result.cached_tokens == _run(requests, "lru", 4000).result.cached_tokens
    small = _run(requests, "adaptive", 8, fixed_share=0.3)
    assert small.hot.eviction.num_refused > 0  # control: a sampling cache does refuse


def test_a_sampling_library_cache_keeps_the_system_prompt_and_restores_it_exactly():
    """The real cache on a tiny llama, held in the ``sample`` regime with a budget of
    8 blocks: other users' chains under the system prompt stay out once it is full,
    the system prompt stays in, and a hit on it gives the live run's logits."""
    model = tiny_model("llama")
    system = prompt(1, 64)  # 4 blocks of 16
    config = CacheConfig(block_size=16, hot_cache_only=True, eviction="adaptive")
    with PrefixCache(model, config.replace(hot_max_bytes=8 * 8192), model_id="tiny") as pc:
        hot = pc.hot
        reach = Reach(decide_after=1 << 30)
        reach.share = 0.3
        hot.eviction.adaptive = AdaptivePolicy(8, hot._lru, hot._children, reach=reach)
        for user in range(12):
            tokens = system + prompt(100 + user, 48)
            cache = make_prompt_cache(model)
            prefill(model, tokens, cache)
            pc.store(tokens, cache)
        assert hot.eviction.num_refused > 0  # later users' chains stayed out
        probe = system + prompt(999, 20)
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 64
        got = prefill(model, probe[64:], cache)
        assert max_diff(got, live_logits(model, probe, 64)) == 0.0
        other = live_logits(model, prompt(2, 64) + probe[64:], 64)
        assert max_diff(got, other) > 0.0  # control: another prefix gives other logits
        mx.clear_cache()


def test_ssd_admission_by_reach():
    config = CacheConfig(hot_cache_only=True, ssd_admit_after=0, ssd_max_bytes=1 << 30)
    governor = WriteGovernor(config, Stats(), Pins(), HotTier(1 << 20))
    keys = [i.to_bytes(16, "little") for i in range(400)]
    for key in keys:
        governor.seen(key)
    assert all(governor.admitted(k) for k in keys)  # reach unknown: every block
    governor.reach.share = 0.3
    inside = [k for k in keys if sampled(k, 0.1)]
    assert 10 < len(inside) < 80
    assert [k for k in keys if governor.admitted(k)] == inside  # new ones: the sample
    governor.seen(keys[0])
    assert governor.admitted(keys[0])  # seen twice: admitted
    governor.reach.share = 0.05
    assert [k for k in keys if governor.admitted(k)] == [keys[0]]  # only what came back
    governor.reach.share = 0.7
    assert all(governor.admitted(k) for k in keys)
    # control: admission after 2 sightings ignores the reach
    counted = WriteGovernor(config.replace(ssd_admit_after=2), Stats(), Pins(), HotTier(1))
    assert counted.reach is None and not counted.admitted(keys[1])


def test_ssd_admission_by_reach_in_a_simulation(tmp_path):
    """A small SSD behind a small hot tier, on conversations every fourth request and
    one-off chains between: admission by reach, once known, writes less than
    admitting every block (control)."""
    requests = read_trace(_write(tmp_path / "t.jsonl", _flood_trace()))

    def run(admit: int) -> Simulation:
        sim = Simulation(
            SimConfig(LLAMA, 2 * BLOCK, 8 * BLOCK, eviction="lru", ssd_admit_after=admit)
        )
        if admit == 0:
            sim.governor.reach.share = 0.3  # as a measured reach of 0.3 would hold it
            sim.governor.reach.decide_after = 1 << 30
        return sim.run(requests)

    every, by_reach = run(1), run(0)
    assert by_reach.ssd_bytes_written < every.ssd_bytes_written / 3
    assert by_reach.hit_tokens["ssd"] >= every.hit_tokens["ssd"]
