"""The soak harness (tools/soak.py) in short: every scenario, small counts.

Each run asserts zero wrong restores and zero errors; the negative controls
show that the exactness checks reject another prompt's cache.
"""

from __future__ import annotations

import os
import sys

import pytest
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from soaklib import common, corrupt, crash, diskfull, memory, procs, threads
from soaklib.common import BLOCK, Tally, Workload, make_prompts, open_cache, prefill

from prefixcache.blocks import Block
from prefixcache.hashing import token_bytes


def assert_clean(result) -> None:
    assert result.wrong == 0 and result.errors == 0, result.findings
    assert result.ops > 0


def test_negative_control_exactness_check_catches_a_wrong_prefix():
    work = Workload(make_prompts(2, 1))
    assert work.negative_control()
    other = make_prompt_cache(work.model)  # prompt 1's first blocks, checked as prompt 0's
    prefill(work.model, work.prompts[1][: 2 * BLOCK], other)
    assert not work.same_kv(0, other, 2 * BLOCK)


def test_negative_control_served_wrong_cache_is_counted():
    """A hot block carrying another prompt's payload is served, and counted wrong."""
    work = Workload(make_prompts(2, 1))
    tally = Tally()
    with open_cache(work.model, None) as pc:
        work.serve(pc, 0, tally)
        work.serve(pc, 1, tally)
        second = [token_bytes(p[BLOCK : 2 * BLOCK]) for p in work.prompts]
        a, b = (next(blk for blk in pc.hot if blk.tokens == t) for t in second)
        pc.hot._lru[a.key] = Block.make(a.key, a.parent, a.root, 1, a.tokens, b.arrays)
        work.serve(pc, 0, tally)
    assert tally.wrong == 1 and tally.checked == 1


def test_crash_few_kills(tmp_path):
    assert_clean(crash.run(crash.CrashSetup(kills=3, seed=1, max_delay=1.0), str(tmp_path)))


def test_corrupt_few_hundred(tmp_path):
    result = corrupt.run(corrupt.CorruptSetup(corruptions=240, seed=2), str(tmp_path))
    assert_clean(result)
    assert "counted corrupt: 240" in result.notes


def test_threads_few_hundred_ops(tmp_path):
    setup = threads.ThreadSetup(threads=4, ops=100, quiesce_every=50, logits_every=10)
    result = threads.run(setup, str(tmp_path))
    assert_clean(result)
    assert result.ops == 400 and result.checked > 0


def test_threads_handing_caches_over(tmp_path):
    setup = threads.ThreadSetup(
        threads=4, ops=100, quiesce_every=50, hand_over=True, hot_bytes=160 * threads.BLOCK_BYTES
    )
    result = threads.run(setup, str(tmp_path))
    assert_clean(result)
    assert result.ops == 400 and result.checked > 0
    hits = int(result.notes.rsplit("fetches from kept sequences ", 1)[1])
    assert hits > 0  # views of kept sequences were fetched, written into and checked


def test_processes_share_a_directory(tmp_path):
    """Known finding (docs/reliability.md): ``verify`` beside servers can report a
    block evicted meanwhile as "payload file is missing" (eviction unlinks the
    payload before its transaction commits). Any other error fails."""
    result = procs.run(procs.ProcSetup(procs=2, ops=30), str(tmp_path))
    assert result.wrong == 0 and result.ops == 60
    assert all("payload file is missing" in f for f in result.findings), result.findings


def test_disk_full(tmp_path):
    result = diskfull.run(diskfull.DiskFullSetup(groups=4), str(tmp_path))
    if result.notes.startswith("SKIPPED"):
        pytest.skip(result.notes)
    assert_clean(result)
    assert "num_disk_full=1" in result.notes and "hot-only" in result.notes


def test_memory_small_run(tmp_path):
    setup = memory.MemorySetup(requests=120, every=20, pool=40)
    assert_clean(memory.run(setup, str(tmp_path)))


def test_on_disk_sample_never_counts_an_evicted_block_beside_its_replacement(tmp_path):
    """The sustained scenario's sample read 264 B over the SSD cap where the tier never
    was: its walk counted a block evicted behind it and the one written in its room
    ahead of it. The sample of one instant does not; the plain walk (control) does."""
    blocks = tmp_path / "blocks"
    for name in ("00", "ff"):
        (blocks / name).mkdir(parents=True)
        (blocks / name / f"{name}.safetensors").write_bytes(b"x" * 100)
    newest = max(os.stat(p).st_ctime_ns for p in blocks.glob("*/*"))
    while common.coarse_now_ns() <= newest:  # the files are older than the sample's instant
        pass

    def walk_while_evicting():
        files = common.walk_files(str(tmp_path))
        path, st = next(files)
        yield path, st
        os.unlink(path)  # evicted behind the walk; the cap (200 B) is never passed
        ahead = blocks / ("ff" if os.path.basename(os.path.dirname(path)) == "00" else "00")
        (ahead / "new.safetensors").write_bytes(b"x" * 100)  # its replacement, ahead
        yield from files

    before = common.coarse_now_ns()
    assert common.bytes_before(walk_while_evicting(), before) == 200
    os.unlink(next(blocks.glob("*/new.safetensors")))
    (blocks / "00" / "00.safetensors").write_bytes(b"x" * 100)
    (blocks / "ff" / "ff.safetensors").write_bytes(b"x" * 100)
    assert common.bytes_before(walk_while_evicting(), None) == 300  # the plain walk: over
