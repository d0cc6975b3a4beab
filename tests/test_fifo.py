"""FIFO eviction (tiers/hot/fifo.py) against a plain scan in storing order."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from test_traces import BLOCK, LLAMA, _plain_lru, _random_trace, _write

from prefixcache.blocks import Block
from prefixcache.tiers.hot.tier import HotTier
from prefixcache.tiers.pins import Pins
from prefixcache.traces.reader import read_trace
from prefixcache.traces.simulator import SimConfig, Simulation

ROOT = b"\0" * 16


def _plain_fifo(trace, capacity: int) -> int:
    """Cached tokens of a plain FIFO of chain prefixes: the first stored leaf goes;
    a block whose parent is not held goes before all others, as the hot tier puts it."""
    order: OrderedDict[tuple, None] = OrderedDict()
    cached = 0
    for _, ids in trace:
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hit = 0
        while hit < len(keys) and keys[hit] in order:
            hit += 1
        cached += 512 * hit
        for key in keys[hit:]:
            order[key] = None
            if len(key) > 1 and key[:-1] not in order:
                order.move_to_end(key, last=False)
            while len(order) > capacity:
                victim = next(k for k in order if not any(c[:-1] == k for c in order))
                del order[victim]
    return cached


# A used again, then C needs room: LRU keeps A, FIFO lets it go first
_REUSED = [(0, [0, 10, 11]), (1000, [1, 20, 21]), (2000, [0, 10, 11]), (3000, [2, 30, 31])]
_REUSED.append((4000, [0, 10, 11]))


@pytest.mark.parametrize("seed", [0, 1, 2, None])
def test_simulate_fifo_agrees_with_a_plain_scan(tmp_path, seed):
    trace = _random_trace(seed) if seed is not None else _REUSED
    requests = read_trace(_write(tmp_path / "t.jsonl", trace))
    for capacity in (4, 6, 12):
        config = SimConfig(LLAMA, capacity * BLOCK, eviction="fifo")
        assert Simulation(config).run(requests).cached_tokens == _plain_fifo(trace, capacity)
    # negative controls: FIFO is not LRU, and the capacity matters
    if seed is None:
        assert _plain_fifo(trace, 6) != _plain_lru(trace, 6)
    else:
        assert _plain_fifo(trace, 13) != _plain_fifo(trace, 12)


class ScanFifo:
    """The reference: every block in storing order (the cold end first), scanned for
    the first unpinned leaf; pinned leaves met go to the back."""

    def __init__(self, children: dict[bytes, dict[bytes, None]], pins: Pins) -> None:
        self.children, self.pins = children, pins
        self.order: OrderedDict[bytes, None] = OrderedDict()

    def added(self, key: bytes, *, first_to_go: bool) -> None:
        self.order[key] = None
        if first_to_go:
            self.order.move_to_end(key, last=False)

    def removed(self, key: bytes, parent: bytes) -> None:
        self.order.pop(key, None)

    def victim(self) -> bytes | None:
        met, found = [], None
        for key in self.order:
            if self.children.get(key):
                continue
            if self.pins.holds(key):
                met.append(key)
                continue
            found = key
            break
        for key in met:
            self.order.move_to_end(key)
        return found


def _random_run(hot: HotTier, seed: int) -> list[bytes]:
    """Puts (some at the cold end, under random parents), pins, unpins, touches and
    removals; returns the keys evicted, in order."""
    rng = random.Random(seed)
    gone: list[bytes] = []
    hot.on_evict = lambda b, d: gone.append(b.key)
    keys: list[bytes] = []
    for i in range(3000):
        roll = rng.random()
        held = [k for k in keys[-300:] if k in hot]  # the older ones are mostly gone
        if roll < 0.08 and held:
            hot.pins.add([rng.choice(held)], until=float("inf"))
        elif roll < 0.12 and held:
            hot.pins.remove([rng.choice(held)])
        elif roll < 0.17 and held:
            hot.touch([rng.choice(held)])
        elif roll < 0.2 and held:
            hot.remove([rng.choice(held)])
        else:
            parent = rng.choice(held) if held and rng.random() < 0.7 else ROOT
            key = i.to_bytes(16, "little")
            keys.append(key)
            block = Block(key, parent, ROOT, 1, b"", {}, 64 * rng.randint(1, 3))
            hot.put(block, at_cold_end=rng.random() < 0.1)
    return gone


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fifo_evicts_as_the_scan_in_storing_order(seed):
    fast = HotTier(20 * 64, policy="fifo")
    plain = HotTier(20 * 64, policy="fifo")
    assert plain.eviction.fifo is not None
    plain.eviction.fifo = ScanFifo(plain._children, plain.pins)  # the reference
    got, want = _random_run(fast, seed), _random_run(plain, seed)
    assert len(want) > 500 and got == want
    # negative control: LRU evicts another sequence on the same operations
    assert _random_run(HotTier(20 * 64, policy="lru"), seed) != want


def test_pinned_leaves_passed_over_go_to_the_back():
    hot = HotTier(3 * 64, policy="fifo")
    gone: list[bytes] = []
    hot.on_evict = lambda b, d: gone.append(b.key[:1])
    blocks = [Block(n.ljust(16, b"."), ROOT, ROOT, 0, b"", {}, 64) for n in (b"a", b"b", b"c")]
    for b in blocks:
        hot.put(b)
    hot.pins.add([blocks[0].key], until=float("inf"))
    hot.put(Block(b"d".ljust(16, b"."), ROOT, ROOT, 0, b"", {}, 64))
    hot.pins.remove([blocks[0].key])
    hot.put(Block(b"e".ljust(16, b"."), ROOT, ROOT, 0, b"", {}, 64))
    # a was passed over while pinned: it went behind c and d, so c goes next
    assert gone == [b"b", b"c"]
