"""Hot tier: byte bound, leaves-first eviction, dirty tracking, against a plain model."""

import mlx.core as mx
import numpy as np
from conftest import prefill, prompt, tiny_model
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.tiers.hot.tier import HotTier

ROOT = b"r" * 16


def block(name: str, parent: bytes = ROOT, nbytes: int = 64, index: int = 0) -> Block:
    key = name.encode().ljust(16, b".")
    arrays = {"0.keys": mx.zeros((nbytes // 4,), mx.float32)}
    return Block.make(key, parent, ROOT, index, b"", arrays)


def test_byte_bound_counts_real_bytes():
    hot = HotTier(max_bytes=200)
    for name in "abc":
        assert hot.put(block(name))
    assert hot.nbytes == 192 and len(hot) == 3
    assert hot.put(block("d"))
    assert hot.nbytes == 192 and len(hot) == 3 and hot.num_evictions == 1
    assert block("a").key not in hot  # LRU went first


def test_never_strands_a_child():
    evicted = []
    hot = HotTier(max_bytes=3 * 64, on_evict=lambda b, dirty: evicted.append(b.key[:1]))
    a = block("a")
    b = block("b", parent=a.key, index=1)
    c = block("c", parent=b.key, index=2)
    for x in (a, b, c):
        hot.put(x)
    hot.touch([a.key])  # the root is most recent, but has a child
    hot.put(block("z"))  # needs room for one block
    assert evicted == [b"c"]  # the leaf goes, not the recently used parent
    assert a.key in hot and b.key in hot


def test_oversized_block_is_refused():
    hot = HotTier(max_bytes=32)
    assert not hot.put(block("a", nbytes=64))
    assert len(hot) == 0 and hot.nbytes == 0


def test_dirty_blocks_reach_the_hook_once():
    seen = []
    hot = HotTier(max_bytes=64, on_evict=lambda b, dirty: seen.append((b.key[:1], dirty)))
    hot.put(block("a"), dirty=True)
    hot.put(block("b"), dirty=False)
    hot.put(block("c"), dirty=True)
    assert seen == [(b"a", True), (b"b", False)]
    assert [b.key[:1] for b in hot.take_dirty()] == [b"c"]
    assert hot.take_dirty() == []


class HotModel(RuleBasedStateMachine):
    """Random puts/touches/pops against a plain-Python model of the invariants."""

    def __init__(self):
        super().__init__()
        self.hot = HotTier(max_bytes=500, on_evict=self.on_evict)
        self.present: dict[bytes, Block] = {}
        self.num = 0

    def on_evict(self, b: Block, dirty: bool) -> None:
        # Invariant at eviction time: no stored block has b as parent.
        assert not any(x.parent == b.key for x in self.present.values() if x.key != b.key)
        self.present.pop(b.key)

    @rule(size=st.integers(1, 60), parent_pick=st.integers(0, 50))
    def put(self, size, parent_pick):
        parents = [ROOT, *self.present]
        parent = parents[parent_pick % len(parents)]
        self.num += 1
        b = block(f"k{self.num}", parent=parent, nbytes=size * 4)
        self.present[b.key] = b
        if not self.hot.put(b):
            self.present.pop(b.key, None)

    @rule(pick=st.integers(0, 50))
    def touch(self, pick):
        if self.present:
            keys = list(self.present)
            self.hot.touch([keys[pick % len(keys)]])

    @invariant()
    def matches_model(self):
        assert {b.key for b in self.hot} == set(self.present)
        assert self.hot.nbytes == sum(b.nbytes for b in self.present.values())
        assert self.hot.nbytes <= self.hot.max_bytes


TestHotModel = HotModel.TestCase
TestHotModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_chain_larger_than_the_budget_evicts_each_block_once():
    evicted = []
    hot = HotTier(max_bytes=2 * 64, on_evict=lambda b, dirty: evicted.append(b.index))
    parent = ROOT
    for i in range(5):
        b = block(f"c{i}", parent=parent, index=i)
        # accepted, even when evicted at once; the manager marks a block cold
        # when its parent is not hot
        assert hot.put(b, dirty=True, at_cold_end=parent != ROOT and parent not in hot)
        parent = b.key
    assert sorted(evicted) == [2, 3, 4] and len(evicted) == 3
    assert {b.index for b in hot} == {0, 1}  # the root-most blocks stay


def deep_chain(hot: HotTier, name: str, depth: int) -> Block:
    """A chain of ``depth`` blocks; returns its leaf."""
    parent = ROOT
    for i in range(depth):
        b = block(f"{name}{i}", parent=parent, index=i)
        hot.put(b)
        parent = b.key
    return b


def evicted_first(cost) -> bytes:
    """Which leaf goes first: an old deep history's or a newer shallow prompt's."""
    gone = []
    hot = HotTier(max_bytes=7 * 64, on_evict=lambda b, d: gone.append(b.key[:2]), cost=cost)
    deep = deep_chain(hot, "d", 6)  # the older, and its leaf sits at depth 5
    hot.put(block("s0"))  # a newer one-block prompt
    assert deep.key in hot and len(hot) == 7
    hot.put(block("n0"))  # room for one block: one of the two leaves goes
    return gone[0]


def test_cost_aware_eviction_keeps_the_deep_block_lru_does_not():
    """Recompute cost grows with depth: among old leaves, the cheap one goes first."""
    by_depth = lambda b: float(1 + b.index) ** 2  # noqa: E731
    assert evicted_first(by_depth) == b"s0"
    # control: without a cost (LRU), the least recently used leaf goes: the deep one
    assert evicted_first(None) == b"d5"
    # and with equal costs, recency decides alone
    assert evicted_first(lambda b: 1.0) == b"d5"


def test_cost_aware_eviction_never_takes_a_pinned_or_inner_block():
    gone = []
    hot = HotTier(max_bytes=4 * 64, on_evict=lambda b, d: gone.append(b.key[:2]), cost=float_index)
    leaf = deep_chain(hot, "a", 3)
    hot.pins.add([leaf.key], float("inf"))  # the deep leaf is pinned
    hot.put(block("b0"))
    hot.put(block("c0"))
    hot.put(block("e0"))  # two must go: the shallow leaves, not the pinned or inner ones
    assert sorted(gone) == [b"b0", b"c0"]
    assert all(block(f"a{i}").key in hot for i in range(3))


def float_index(b: Block) -> float:
    return float(1 + b.index)


def test_cost_aware_eviction_ages_out_a_deep_chain_nobody_uses():
    """Credits on a byte clock: a deep history outlives newer shallow prompts for a
    while (its extra life), but the clock moves with every store, so once unused
    long enough it goes (a rank + worth rule kept it for good); the same chain,
    touched now and then, stays. Control: LRU evicts it at the first eviction."""

    def run(cost, touch_every: int | None) -> int | None:
        gone: list[bytes] = []
        hot = HotTier(max_bytes=8 * 64, on_evict=lambda b, d: gone.append(b.key), cost=cost)
        deep = deep_chain(hot, "d", 6)  # leaf at depth 5: worth 36 against 1
        for i in range(200):
            if touch_every and i % touch_every == 0:
                hot.touch([block(f"d{j}").key for j in range(6)])
            hot.put(block(f"p{i}"))  # one-block prompts, each used once
            if deep.key in gone:
                return i  # the deep leaf went after this many prompts
        return None

    by_depth = lambda b: float(1 + b.index) ** 2  # noqa: E731
    aged = run(by_depth, None)
    assert aged is not None and aged > 10  # it outlived many newer prompts, then aged out
    assert run(by_depth, 5) is None  # used now and then: kept
    assert run(None, None) == 2  # control: LRU takes it at the first eviction


def test_a_store_makes_the_host_views_a_restore_copies_from():
    """Made on the storing thread for each block the store keeps hot (off the next
    fetch's path), equal to the blocks' bytes, and let go with the block."""
    model = tiny_model("llama")
    tokens = prompt(1, 64)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    with PrefixCache(model, CacheConfig(block_size=16, hot_cache_only=True), model_id="t") as pc:
        pc.store(tokens, cache)
        made = pc.hot.views._made
        assert set(made) == set(pc.hot._lru) and len(made) == 4
        block, views = made[next(iter(made))]
        for name, view in views.items():  # a block of a run: a view of its run's bytes
            want = np.asarray(memoryview(mx.contiguous(block.arrays[name])).cast("B"))
            assert np.array_equal(view.reshape(-1), want)
        pc.trim_hot(0)
        assert not made


def test_snapshots_are_shed_inside_chains_only_oldest_first():
    """Blocks with one child lose their snapshot first, oldest first; chain ends and
    branch points keep theirs (where prompts resume). Control: then blocks go."""
    shed = []

    def lean(b: Block) -> Block | None:
        if b.nbytes == 60:
            return None
        shed.append(b.key[:2])
        return Block(b.key, b.parent, b.root, b.index, b"", {}, 60)

    hot = HotTier(max_bytes=10_000, shed=lean)
    parent = ROOT
    for i in range(5):
        name = f"a{i}".encode().ljust(16, b".")
        hot.put(Block(name, parent, ROOT, i, b"", {}, 100))
        parent = name
    branch_point = b"a2".ljust(16, b".")
    hot.put(Block(b"b".ljust(16, b"."), branch_point, ROOT, 3, b"", {}, 100))
    assert hot.evict_to(hot.nbytes - 3 * 40) == 0
    assert shed == [b"a0", b"a1", b"a3"]  # a2 branches, a4 and b end chains
    assert hot.evict_to(hot.nbytes - 1) == 1  # nothing left to shed: a leaf goes
    assert shed == [b"a0", b"a1", b"a3"]


def test_fifo_evicts_the_first_stored_leaf_even_if_used():
    def first_gone(policy: str) -> bytes:
        gone = []
        hot = HotTier(3 * 64, on_evict=lambda b, d: gone.append(b.key[:1]), policy=policy)
        for name in "abc":
            hot.put(Block(name.encode().ljust(16, b"."), ROOT, ROOT, 0, b"", {}, 64))
        hot.touch([b"a".ljust(16, b".")])
        hot.put(Block(b"d".ljust(16, b"."), ROOT, ROOT, 0, b"", {}, 64))
        return gone[0]

    assert first_gone("fifo") == b"a"
    assert first_gone("lru") == b"b"  # control: a use renews a block under LRU
