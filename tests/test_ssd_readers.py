"""The SSD stream's reader threads: how many, which runs each reads, what they hand over."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from ssd_child import LAYOUT, check_block
from test_ssd_runs import assert_in_place, make_meta, path_of
from test_ssd_stream import chain_dest, flip_byte, placed_into, stored

from prefixcache.memory.host import Placed, PlacedRun
from prefixcache.tiers.ssd import readers
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd import stream as ssd_stream
from prefixcache.tiers.ssd.prime import cached
from prefixcache.tiers.ssd.read_into import Job
from prefixcache.tiers.ssd.stream import stream


def test_a_reader_stuck_on_a_run_leaves_the_later_runs_to_the_others(tier, monkeypatch):
    """Runs go to whichever reader is free: with one reader held up on run 1 until
    every later run is placed, the other reads them all (dealt in turn, the stuck
    reader would own runs 3 and 5 and wait for itself until the timeout)."""
    monkeypatch.setattr(readers, "_WARM_READERS", 2)
    monkeypatch.setattr(readers, "_COLD_READERS", 2)
    keys = stored(tier, 31, 13)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 2 * tier.get_meta(keys[0]).file_bytes)
    dest = chain_dest(13)
    place = placed_into(dest, skip=set(), names=set(LAYOUT))
    later_done = threading.Event()
    placed_by: dict[int, set[str]] = {}
    lock = threading.Lock()
    timed_out = []

    def held(index, name, dtype, shape, count=1):
        with lock:
            placed_by.setdefault(index, set()).add(threading.current_thread().name)
            if {i for i in placed_by if i > 1} >= {3, 5, 7, 9, 11}:
                later_done.set()
        if index == 1 and not later_done.wait(timeout=10):
            timed_out.append(index)
        return place(index, name, dtype, shape, count)

    blocks = [b.to_block() for b in stream(tier.reads, keys, held)]
    assert not timed_out
    assert [b.index for b in blocks] == list(range(13))
    for block in blocks:
        check_block(block)
    for i, key in enumerate(keys):
        assert_in_place(dest, key, i, set(LAYOUT))
    (stuck,) = placed_by[1]
    assert all(stuck not in placed_by[i] for i in (3, 5, 7, 9, 11))


def evict(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no page-cache probe on this OS")
def test_a_chain_in_the_page_cache_gets_the_warm_reader_count(tier, monkeypatch):
    monkeypatch.setattr(readers, "_WARM_READERS", 2)
    monkeypatch.setattr(readers, "_COLD_READERS", 3)
    keys = stored(tier, 32, 9)
    jobs = ssd_stream._jobs(tier, keys)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", jobs[0].meta.file_bytes)  # a run per block
    for job in jobs:
        with open(job.path, "rb") as f:
            f.read()
    assert readers._warm(jobs)
    started = readers.Readers(jobs, None)
    started.stop()
    assert (started.warm, started.n) == (True, 2)
    evict([job.path for job in jobs])
    if cached(jobs[-1].path, jobs[-1].meta.file_bytes):
        pytest.skip("this filesystem keeps the pages cached")
    # one probed file out of the page cache (the last) is enough to read as cold
    for job in jobs[:-1]:
        with open(job.path, "rb") as f:
            f.read()
    evict([jobs[-1].path])
    started = readers.Readers(jobs, None)
    started.stop()
    assert (started.warm, started.n) == (False, 3)
    # the blocks are the same either way
    assert [b.index for b in stream(tier.reads, keys)] == list(range(9))


def test_a_run_hands_over_its_blocks_as_placed_runs(tier):
    """A block whose tensors all went in with its run's copies comes as a PlacedRun:
    its names in file order, and each tensor, looked at, a Placed of the block's
    own tokens in the destination."""
    keys = stored(tier, 33, 9)
    dest = chain_dest(9)
    blocks = list(stream(tier.reads, keys, placed_into(dest, skip=set(), names=set(LAYOUT))))
    assert type(blocks[0].arrays) is not PlacedRun  # the first block is read alone
    for i, block in enumerate(blocks[1:], start=1):
        assert type(block.arrays) is PlacedRun
        assert list(block.arrays) == list(LAYOUT)
        for name, placed in block.arrays.items():
            assert type(placed) is Placed and placed.shape == LAYOUT[name][2]
            want = dest[name][:, :, 16 * i : 16 * (i + 1), :]
            assert placed.region.shape == want.shape
            assert np.shares_memory(placed.region, want)
            assert placed.region.ctypes.data == want.ctypes.data
        check_block(block.to_block())


def test_served_blocks_are_counted_when_the_stream_ends(tier):
    keys = stored(tier, 34, 6)
    before = tier.stats()
    blocks = stream(tier.reads, keys)
    got = [next(blocks).index, next(blocks).index]
    blocks.close()  # a restore that stops early
    after = tier.stats()
    assert got == [0, 1]
    assert after["num_loads"] - before["num_loads"] == 2
    nbytes = sum(tier.get_meta(k).nbytes for k in keys[:2])
    assert after["load_bytes"] - before["load_bytes"] == nbytes
    # a damaged block is a miss, not a load
    flip_byte(path_of(tier, keys[3]), 1)
    out = list(stream(tier.reads, keys))
    assert out[3] is None and sum(b is not None for b in out) == 5
    assert tier.stats()["num_loads"] - after["num_loads"] == 5


def test_a_tensor_placed_block_by_block_beside_run_copies_keeps_file_order(tier):
    """One tensor gets no region for a run (only block by block): the run's other
    tensors still go in with one copy each, and every block comes as Placed
    tensors in file order, each where it belongs."""
    keys = stored(tier, 35, 9)
    dest = chain_dest(9)
    place = placed_into(dest, skip=set(), names=set(LAYOUT))

    def no_run_for_one(index, name, dtype, shape, count=1):
        if name == "1.keys" and count > 1:
            return None
        return place(index, name, dtype, shape, count)

    blocks = list(stream(tier.reads, keys, no_run_for_one))
    for i, block in enumerate(blocks[1:], start=1):
        assert type(block.arrays) is not PlacedRun
        assert list(block.arrays) == list(LAYOUT)
        assert all(type(a) is Placed for a in block.arrays.values())
        check_block(block.to_block())
        assert_in_place(dest, keys[i], i, set(LAYOUT))


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no page-cache probe on this OS")
def test_files_are_asked_into_the_page_cache_only_when_cold(tier, monkeypatch):
    monkeypatch.setattr(readers, "_WARM_READERS", 2)
    keys = stored(tier, 36, 9)
    jobs = ssd_stream._jobs(tier, keys)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 2 * jobs[0].meta.file_bytes)  # five runs
    real = os.posix_fadvise
    asked: list[int] = []

    def counting(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append(fd)
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", counting)
    for job in jobs:
        with open(job.path, "rb") as f:
            f.read()
    assert [b.index for b in stream(tier.reads, keys)] == list(range(9))
    assert asked == []  # warm: the files are there already
    evict([job.path for job in jobs])
    if cached(jobs[-1].path, jobs[-1].meta.file_bytes):
        pytest.skip("this filesystem keeps the pages cached")
    assert [b.index for b in stream(tier.reads, keys)] == list(range(9))
    assert len(asked) == 9  # cold: every file of every run


def test_a_chain_of_a_few_runs_is_not_probed(tier, monkeypatch):
    """As many readers as runs either way: a request's few blocks pay no probe."""
    monkeypatch.setattr(readers, "_WARM_READERS", 2)
    keys = stored(tier, 37, 2)
    probed: list[str] = []
    monkeypatch.setattr(readers, "cached", lambda path, size: probed.append(path) or True)
    assert [b.index for b in stream(tier.reads, keys)] == [0, 1]
    assert probed == []
    more = stored(tier, 38, 9)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", tier.get_meta(more[0]).file_bytes)  # 9 runs
    assert [b.index for b in stream(tier.reads, more)] == list(range(9))
    assert len(probed) == 3  # control: a longer chain is probed


def test_readers_take_the_first_run_then_the_large_files_runs(monkeypatch):
    """A hybrid chain's state snapshot (one large file at its end) is taken right
    after the first run, not last (where one reader would read it alone); every
    run is taken once."""
    monkeypatch.setattr(ssd_runs, "SMALL_READ", 150)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 2 * 100)
    sizes = [100, 100, 100, 100, 100, None, 100, 700]
    jobs = [
        Job(b"k", None, None, "p") if size is None else Job(b"k", b"raw", make_meta(size, i), "p")
        for i, size in enumerate(sizes)
    ]
    runs = ssd_runs.plan_runs(jobs)
    assert [list(r) for r in runs] == [[0], [1, 2], [3, 4], [5], [6], [7]]
    assert readers._order(jobs, runs) == [0, 5, 1, 2, 3, 4]
    assert readers._order([], []) == []
