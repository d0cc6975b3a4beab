"""SSD restore fast path: runs of small payload files verified before they are placed
(one copy per tensor and run), the large-file path, one LMDB read per chain, the
cached header parse."""

from __future__ import annotations

import json
import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import LAYOUT, block_key, check_block, expected_bits, make_block
from test_ssd_stream import chain_dest, flip_byte, placed_into, stored

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs.kv import KVBuilder
from prefixcache.errors import PayloadError
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.memory.host import HostArray, Placed, contiguous
from prefixcache.tiers.base import Tier
from prefixcache.tiers.ssd import payload as payload_module
from prefixcache.tiers.ssd import readers
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd.files import payload_path
from prefixcache.tiers.ssd.payload import PAYLOAD_FORMAT, encode_header, parse_header
from prefixcache.tiers.ssd.read_into import Job
from prefixcache.tiers.ssd.stream import stream
from prefixcache.tiers.ssd.tier import SsdTier


@pytest.fixture(params=["runs", "large"])
def path_kind(request, monkeypatch):
    """Every payload through the small-file runs, or through the direct large-file read."""
    if request.param == "large":
        monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    return request.param


def path_of(tier: SsdTier, key: bytes) -> str:
    return payload_path(os.path.join(tier.path, "blocks"), key)


def assert_in_place(dest: dict[str, np.ndarray], key: bytes, index: int, names) -> None:
    for name, bits in expected_bits(key).items():
        if name in names:
            got = dest[name][:, :, 16 * index : 16 * (index + 1), :].view(bits.dtype)
            np.testing.assert_array_equal(got, bits)


def test_plan_runs_cuts_at_the_first_block_sizes_budget_and_non_small_jobs(monkeypatch):
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 3 * 100)
    monkeypatch.setattr(ssd_runs, "SMALL_READ", 150)

    def job(size: int | None, index: int) -> Job:
        if size is None:
            return Job(b"k", None, None, "p")  # queued or absent
        return Job(b"k", b"raw", make_meta(size, index), "p")

    sizes = [100, 100, 100, 100, 100, None, 100, 100, 200, 100, 90, 90]
    got = [list(r) for r in ssd_runs.plan_runs([job(s, i) for i, s in enumerate(sizes)])]
    # the first alone (it allocates), three at most (RUN_BYTES), a queued one alone,
    # a large one alone, a change of size cuts
    assert got == [[0], [1, 2, 3], [4], [5], [6, 7], [8], [9], [10, 11]]
    assert ssd_runs.plan_runs([]) == []
    # a block another tier holds (chain index 3) cuts: a run is one stretch of the chain
    gap = [job(100, i) for i in (0, 1, 2, 4, 5)]
    assert [list(r) for r in ssd_runs.plan_runs(gap)] == [[0], [1, 2], [3, 4]]


def test_plan_runs_cuts_large_files_at_their_own_budget(monkeypatch):
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 2 * 100)
    monkeypatch.setattr(ssd_runs, "LARGE_RUN_BYTES", 3 * 200)
    monkeypatch.setattr(ssd_runs, "SMALL_READ", 150)

    def job(size: int, index: int) -> Job:
        return Job(b"k", b"raw", make_meta(size, index), "p")

    sizes = [200, 200, 200, 200, 200, 100, 100, 100, 700, 700, 200, 200]
    got = [list(r) for r in ssd_runs.plan_runs([job(s, i) for i, s in enumerate(sizes)])]
    # large files of one size: three a run (LARGE_RUN_BYTES), small ones two (RUN_BYTES);
    # a file over the budget alone
    assert got == [[0], [1, 2, 3], [4], [5, 6], [7], [8], [9], [10, 11]]


def make_meta(nbytes: int, index: int = 0):
    from prefixcache.blocks import BlockMeta

    return BlockMeta(b"k", b"p", b"r", index, b"", nbytes, nbytes + 8, 0, 0.0, 0.0)


def test_a_run_lands_in_place_with_gaps_filled_block_by_block(tier, path_kind):
    """Block 3 cannot be placed (a layer that does not use it): the run around it is
    placed block by block, its tensors come loose, and every byte is where it belongs."""
    keys = stored(tier, 21, 7)
    dest = chain_dest(7)
    seen = []
    place = placed_into(dest, skip={0, 3}, names=set(LAYOUT))

    def counting(index, name, dtype, shape, count=1):
        seen.append((index, count))
        return place(index, name, dtype, shape, count)

    out = [b.to_block() if b is not None else None for b in stream(tier.reads, keys, counting)]
    for block in out:
        check_block(block)
    assert (1, 6) in seen  # the run after the first block was asked for at once
    for i in (1, 2, 4, 5, 6):
        assert_in_place(dest, keys[i], i, set(LAYOUT))
    assert not dest["0.keys"][:, :, 16 * 3 : 16 * 4].any()  # block 3: no place, untouched


def test_a_run_is_placed_with_one_request_per_tensor(tier, path_kind):
    keys = stored(tier, 22, 9)
    dest = chain_dest(9)
    place = placed_into(dest, skip=set(), names=set(LAYOUT))
    asks = []

    def counting(index, name, dtype, shape, count=1):
        asks.append((index, name, count))
        return place(index, name, dtype, shape, count)

    kinds = [{type(a) for a in b.arrays.values()} for b in stream(tier.reads, keys, counting)]
    assert kinds == [{Placed}] * 9
    assert sorted(asks) == sorted(
        [(0, name, 1) for name in LAYOUT] + [(1, name, 8) for name in LAYOUT]
    )
    for i, key in enumerate(keys):
        assert_in_place(dest, key, i, set(LAYOUT))


@pytest.mark.parametrize("damage", ["flip", "truncate", "lengthen", "delete"])
def test_a_bad_file_in_a_run_is_a_miss_and_never_reaches_its_place(tier, path_kind, damage):
    keys = stored(tier, 23, 6)
    path = path_of(tier, keys[3])
    if damage == "delete":
        os.unlink(path)
    elif damage == "flip":
        flip_byte(path, 3)
    else:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(size - 1)
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\0")
    dest = chain_dest(6)
    out = list(stream(tier.reads, keys, placed_into(dest, skip=set(), names=set(LAYOUT))))
    assert out[3] is None
    assert all(isinstance(a, Placed) for i in (0, 1, 2, 4, 5) for a in out[i].arrays.values())
    for i in (0, 1, 2, 4, 5):
        check_block(out[i].to_block())
        assert_in_place(dest, keys[i], i, set(LAYOUT))
    assert tier.stats()["num_corrupt"] == 1 and tier.get_meta(keys[3]) is None
    if path_kind == "runs" and damage == "flip":  # verified before anything is placed
        assert not dest["1.values"][:, :, 16 * 3 : 16 * 4].any()


def test_both_paths_give_the_same_blocks(tier, monkeypatch):
    keys = stored(tier, 24, 5)
    small = [b.to_block() for b in stream(tier.reads, keys)]
    monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    large = [b.to_block() for b in stream(tier.reads, keys)]
    assert [b.key for b in small] == [b.key for b in large] == keys
    for a, b in zip(small, large, strict=True):
        check_block(a)  # every element's bits, as written
        check_block(b)


def test_unplaced_tensors_come_loose_in_file_order(tier, path_kind):
    keys = stored(tier, 25, 3)
    dest = chain_dest(3)
    place = placed_into(dest, skip=set(), names={"1.keys"})
    for block in stream(tier.reads, keys, place):
        assert list(block.arrays) == list(LAYOUT)
        kinds = {n: type(a) for n, a in block.arrays.items()}
        assert kinds == {n: Placed if n == "1.keys" else HostArray for n in LAYOUT}
        check_block(block.to_block())


def test_a_bad_file_among_loose_blocks_leaves_its_reader_the_loose_buffer(tier, path_kind):
    """No place at all: every block comes loose, each lending its reader's loose
    buffer. A file that fails its checksum lends nothing, so the reader keeps the
    buffer it took for it and reads the later blocks of its run (the control: a
    reader that lost it waits for it forever)."""
    keys = stored(tier, 27, 6)
    flip_byte(path_of(tier, keys[2]), 3)
    out: list = []
    reading = threading.Thread(
        target=lambda: out.extend(
            b if b is None else b.to_block() for b in stream(tier.reads, keys)
        ),
        daemon=True,
    )
    reading.start()
    reading.join(60)  # a guard only: the stream ends at once unless a reader hangs
    assert not reading.is_alive(), "a reader waits for a loose buffer nobody gives back"
    assert out[2] is None and len(out) == 6
    for i in (0, 1, 3, 4, 5):
        check_block(out[i])


def test_a_chain_is_looked_up_in_one_index_read(tier):
    keys = stored(tier, 26, 12)
    chain = [*keys, block_key(26, 12)]
    reads = []
    shared = tier.index._shared
    real = shared.txn

    def counted(fn, *, write=False):
        reads.append(write)
        return real(fn, write=write)

    shared.txn = counted
    try:
        got = tier.held(chain, 0)
        assert [m.key for m in got] == keys and reads == [False]
        reads.clear()
        assert [m.key for m in tier.held(chain, 5)] == keys[5:] and reads == [False]
        reads.clear()
        default = Tier.held(tier, chain, 0)  # the contract's default: one read per key
        assert [m.key for m in default] == keys and len(reads) == len(chain)
    finally:
        shared.txn = real


def test_held_goes_on_past_a_block_still_queued(tmp_path):
    import threading

    hold = threading.Event()
    config = CacheConfig(
        ssd_run_tokens=0, ssd_dir=str(tmp_path / "ssd"), ssd_max_bytes=1 << 30, ssd_min_free_bytes=0
    )
    tier = SsdTier(config, writer_hold=hold)
    try:
        blocks = [make_block(27, i) for i in range(5)]
        hold.set()
        for b in blocks[:2]:
            tier.put(b)
        tier.flush()
        hold.clear()
        tier.put(blocks[2])  # queued: not in the index yet
        hold.set()
        tier.flush()
        hold.clear()
        for b in blocks[3:]:
            tier.put(b)  # queued behind the hold
        keys = [b.key for b in blocks]
        assert [m.key for m in tier.held([*keys, block_key(27, 9)], 0)] == keys
        tier.remove([keys[1]])
        assert [m.key for m in tier.held(keys, 0)] == keys[:1]  # stops at the first gap
    finally:
        hold.set()
        tier.close()


def test_the_cached_header_parse_judges_like_the_full_parse():
    key, other = block_key(28, 0), block_key(28, 1)
    tensors = make_tensors()
    header = encode_header(tensors, key)[8:]
    data_bytes = sum(t.data.nbytes for t in tensors)
    first = parse_header(header, key, data_bytes)
    assert parse_header(header, key, data_bytes) == first  # the cached rest
    assert [s[0] for s in first] == [t.name for t in tensors]
    with pytest.raises(PayloadError, match="does not match key"):
        parse_header(header, other, data_bytes)  # another block's file
    with pytest.raises(PayloadError, match="cover"):
        parse_header(header, key, data_bytes + 1)
    # the rest names the metadata again (its last value wins in JSON), with the key
    # the rest is judged under: the rest alone would pass, the whole header must not
    again = b'"__metadata__":{"format":"%s","key":"%s"}' % (
        PAYLOAD_FORMAT.encode(),
        payload_module._STAND_IN.encode(),
    )
    for name in (again, again.replace(b"__metadata__", b"\\u005f_metadata__")):
        evil = header.rstrip(b" ")[:-1] + b"," + name + b"}"
        assert json.loads(evil)["__metadata__"]["key"] == payload_module._STAND_IN
        with pytest.raises(PayloadError, match="does not match key"):
            parse_header(evil, key, data_bytes)


def make_tensors():
    from prefixcache.memory.host import tensors_of

    arrays = {"0.keys": mx.zeros((1, 2, 4, 8), mx.bfloat16), "0.values": mx.ones((3,), mx.int8)}
    mx.eval(arrays)
    return tensors_of(arrays)


def test_builders_give_a_run_region_only_for_full_blocks():
    from mlx_lm.models.cache import KVCache

    builder = KVBuilder(KVCache(), 40, 256, 8)
    shape = (1, 2, 8, 4)
    spec = Placed(None, mx.bfloat16, shape)
    mx.eval(builder.reserve(0, {"keys": spec, "values": spec}))
    assert builder.destination(1, "keys", mx.bfloat16, shape) is None  # not open yet
    builder.buffers()  # opens the reserved buffers
    one = builder.destination(1, "keys", mx.bfloat16, shape)
    three = builder.destination(1, "keys", mx.bfloat16, shape, 3)
    assert one.shape == (1, 2, 8, 8) and three.shape == (1, 2, 24, 8)
    assert np.shares_memory(one, three) and one.ctypes.data == three.ctypes.data
    assert builder.destination(1, "keys", mx.bfloat16, (1, 2, 5, 4), 3) is None  # a tail
    assert builder.destination(31, "keys", mx.bfloat16, shape, 2) is None  # past the end


def test_the_contiguous_runs_of_a_region_cover_it_in_order():
    buf = np.arange(2 * 3 * 10 * 4, dtype=np.uint8).reshape(2, 3, 10, 4)
    region = buf[:, :, 2:5, :]
    pieces = contiguous(region)
    assert len(pieces) == 6 and all(p.nbytes == 12 for p in pieces)
    assert b"".join(bytes(p) for p in pieces) == region.tobytes()
    whole = contiguous(buf[1])
    assert len(whole) == 1 and bytes(whole[0]) == buf[1].tobytes()
    assert contiguous(buf[:, :, 3:3, :]) == []


@pytest.mark.parametrize("hot_at", [[3], [1, 4]], ids=["one_hot_block", "two_hot_blocks"])
def test_a_chain_with_hot_blocks_between_ssd_blocks_restores_exactly(
    tmp_path, monkeypatch, hot_at, path_kind
):
    """Blocks of one chain held by hot between blocks held only by the SSD tier (as
    eviction and promotion leave them): the SSD blocks around a hot one are not one
    run, so each lands at its own place and the restore equals the live run. The
    control places runs across the gap (the bug this guards against): the blocks
    after it land one place early and the logits differ."""
    model = tiny_model("llama")
    tokens = prompt(31, 8 * 16 + 5)
    config = CacheConfig(ssd_run_tokens=0, block_size=16, promote=False, ssd_dir=str(tmp_path))

    def fetch_logits(pc):
        restored, num = pc.fetch(tokens)
        assert num == 8 * 16 + 4
        assert {type(c.keys) for c in restored} == {mx.array}
        return prefill(model, tokens[num:], restored), num

    with PrefixCache(model, config, model_id="tiny") as pc:
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        pc.store(tokens, cache)
        pc.trim_hot(0)
        pc.flush()
        keys = chain_keys(pc.namespace.root_key(), token_bytes(tokens), 16)
        for i in hot_at:  # back into hot: the chain is ssd, ..., hot, ssd, ...
            assert pc.hot.put(pc.ssd.load(keys[i]))
        assert [k in pc.hot for k in keys] == [i in hot_at for i in range(len(keys))]
        jobs = ssd_runs_jobs(pc, keys, hot_at)
        for run in ssd_runs.plan_runs(jobs):  # a run is a stretch of the chain
            first = jobs[run.start].meta.index
            assert [jobs[j].meta.index for j in run] == list(range(first, first + len(run)))
        logits, num = fetch_logits(pc)
        assert max_diff(logits, live_logits(model, tokens, num)) == 0.0

        # control: the full blocks after the first in one run, across the gap
        def runs(jobs):
            return [range(1), range(1, len(jobs) - 1), range(len(jobs) - 1, len(jobs))]

        monkeypatch.setattr(readers, "plan_runs", runs)
        restored, got = pc.fetch(tokens)
        if got == num:  # the blocks after the gap one place early: other logits
            bad = prefill(model, tokens[got:], restored)
            assert max_diff(bad, live_logits(model, tokens, num)) > 0.0
        else:  # or two readers wrote one region and a block's checksum caught it
            assert got < num and pc.stats()["ssd"]["num_corrupt"] > 0


def ssd_runs_jobs(pc, keys, hot_at) -> list[Job]:
    """The SSD stream's jobs of the chain's blocks that hot does not hold."""
    from prefixcache.tiers.ssd.stream import _jobs

    return _jobs(pc.ssd, [k for i, k in enumerate(keys) if i not in hot_at])


@pytest.mark.parametrize("once", [True, False], ids=["checked-once", "control"])
def test_placed_blocks_of_one_layout_are_checked_once_per_restore(tmp_path, monkeypatch, once):
    """A block read wholly into place with the names of an earlier one skips the
    builders' checks (``placed_checks_only``); the restore stays exact. The control
    checks every block and gives the same logits."""
    monkeypatch.setattr(KVBuilder, "placed_checks_only", once)
    calls = []
    real = KVBuilder.add
    monkeypatch.setattr(KVBuilder, "add", lambda self, i, a: calls.append(i) or real(self, i, a))
    model = tiny_model("llama", num_hidden_layers=2)
    tokens = prompt(30, 64)
    config = CacheConfig(
        ssd_run_tokens=0, block_size=16, hot_max_bytes=1, promote=False, ssd_dir=str(tmp_path)
    )
    with PrefixCache(model, config, model_id="t") as pc:
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        pc.store(tokens, cache)
        pc.flush()
        restored, num = pc.fetch([*tokens, 1])
    assert num == 64
    assert calls == ([0, 0] if once else [i for i in range(4) for _ in range(2)])
    rest = prompt(31, 8)
    got = prefill(model, rest, restored)
    assert max_diff(got, live_logits(model, [*tokens, *rest], 64)) == 0.0
