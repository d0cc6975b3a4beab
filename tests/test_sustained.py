"""Sustained traffic: requests back to back keep the SSD writer's queue bounded,
and the blocks hot evicts reach the SSD tier while requests go on.

Real threads, a real LMDB directory, the tiny llama, the README's loop (fetch,
prefill the rest, store). Every fetch opens the quiet window, so back to back
it is open almost all the time: the background work must still get its share.
A stalled disk (the writer held on an event) shows the back-pressure: the
queue stops at its bound and what does not fit is dropped or written inline,
counted.
"""

from __future__ import annotations

import os
import pathlib
import random
import tempfile
import threading

import pytest
from conftest import prefill, prompt

from prefixcache import CacheConfig, PrefixCache
from prefixcache.prometheus import prometheus_text
from prefixcache.tiers import quiet
from prefixcache.tiers.ssd.index import decode_or_none
from prefixcache.tiers.ssd.tier import SsdTier

BLOCK = 16
HOT = 2 << 20


@pytest.fixture(autouse=True)
def closed_window():
    quiet.close_window()
    yield
    quiet.close_window()


def requests(num: int, seed: int = 0):
    """4 system prompts, random user turns."""
    rng = random.Random(seed)
    systems = [prompt(100 + s, 4 * BLOCK) for s in range(4)]
    for _ in range(num):
        user = [rng.randrange(512) for _ in range(rng.randrange(8, 80))]
        yield systems[rng.randrange(4)] + user


def serve(pc: PrefixCache, model, tokens: list[int]) -> None:
    cache, n = pc.fetch(tokens)
    prefill(model, tokens[n:], cache, step=BLOCK)
    pc.store(tokens, cache)


def config(tmp_path, **changes) -> CacheConfig:
    return CacheConfig(
        block_size=BLOCK,
        hot_max_bytes=HOT,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_max_bytes=16 << 20,
        ssd_min_free_bytes=0,
        **changes,
    )


def run(tmp_path, llama, num: int, **changes) -> tuple[int, int, dict]:
    """Serve ``num`` requests back to back; (peak queue bytes, blocks written
    before any flush, stats then)."""
    peak = 0
    with PrefixCache(llama, config(tmp_path, **changes), model_id="t") as pc:
        writer = pc.tiers.named("ssd").writer
        for tokens in requests(num):
            serve(pc, llama, tokens)
            peak = max(peak, writer.queue_bytes)
        stats = pc.stats()
    return peak, stats["ssd"]["num_writes"], stats


@pytest.fixture
def fast_dir(tmp_path):
    """A directory on tmpfs (fsync is free) where there is one: a disk that keeps
    up with the requests, so only the writer's pace decides."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="prefixcache-test-") as d:
        yield pathlib.Path(d)


def test_back_to_back_requests_reach_the_ssd_while_they_go_on(fast_dir, llama):
    """A queue bound far above what is needed (64 MiB), so the writer cannot wait
    for it to fill, and a disk that keeps up. Every fetch reopens the quiet
    window (50 ms) before it closes, yet the queue stays short and what hot
    spilled is on the SSD before any flush (a writer that waited for the window
    to close held millions of bytes and wrote one batch in 300 requests)."""
    peak, written, stats = run(fast_dir, llama, 300, write_queue_bytes=64 << 20)
    spilled = stats["num_spills"]
    assert spilled > 300  # the run evicts: hot holds far less than it saw
    assert stats["ssd"]["num_dropped_writes"] == 0
    assert peak <= HOT // 2, f"the writer's queue reached {peak} bytes"
    assert written >= 0.8 * spilled, (written, spilled)


def test_the_default_queue_bound_follows_the_hot_budget(tmp_path):
    assert config(tmp_path).write_queue_limit == 4 << 20  # the floor
    assert CacheConfig().write_queue_limit == CacheConfig().hot_max_bytes // 8
    assert CacheConfig(hot_max_bytes=1 << 30).write_queue_limit == 128 << 20
    assert config(tmp_path, write_queue_bytes=1 << 20).write_queue_limit == 1 << 20


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("policy", ["drop", "inline"])
def test_a_stalled_disk_gets_counted_back_pressure_not_ram(tmp_path, llama, policy, write_policy):
    """The writer is held (a disk that writes nothing): the queue stops at its
    bound; ``drop`` counts what it skipped, ``inline`` writes it on the caller's
    thread; the queue never passes its bound, whether blocks go to the SSD when
    hot evicts them or as they are stored."""
    bound = 128 << 10
    hold = threading.Event()
    cfg = config(tmp_path, write_queue_bytes=bound, queue_full=policy, write_policy=write_policy)

    ssd = SsdTier(cfg, writer_hold=hold)
    try:
        with PrefixCache(llama, cfg, model_id="t", tiers=[ssd]) as pc:
            peak = 0
            for tokens in requests(150, seed=1):
                serve(pc, llama, tokens)
                peak = max(peak, ssd.writer.queue_bytes)
                ram = pc.stats()["ram"]  # every byte in RAM, at every request
                assert ram["nbytes"] <= ram["max_bytes"] == HOT + bound, ram
                assert ram["queued_bytes"] == ssd.writer.queue_bytes
            stats = pc.stats()
            assert peak <= bound
            assert "prefixcache_ram_bytes " in prometheus_text(stats)
            if write_policy == "write_back":
                assert stats["num_spills"] > 0
            counts = stats["ssd"]
            if policy == "drop":
                assert counts["num_dropped_writes"] > 0
                assert counts["num_blocks"] == 0  # nothing reached the held disk
            else:
                assert counts["num_dropped_writes"] == 0
                assert counts["num_inline_writes"] > 0
                assert counts["num_blocks"] == counts["num_inline_writes"]
            hold.set()
    finally:
        hold.set()
        ssd.close()


def detached(ssd: SsdTier) -> tuple[int, int]:
    """(blocks indexed, those whose parent is neither their root nor indexed)."""
    rows = [decode_or_none(key, raw) for key, raw in ssd.index.rows()]
    keys = {m.key for m in rows}
    return len(rows), sum(m.parent != m.root and m.parent not in keys for m in rows)


def test_write_back_writes_a_chains_upper_blocks_before_its_leaves(fast_dir, llama):
    """Hot keeps the system prompts' blocks (every request uses them) and evicts the
    user turns under them. What the writer has put on disk, before any flush of
    hot (a process killed now loses hot), must be reachable from its root: each
    block's parent is on disk too. Written alone, every leaf was unreachable."""
    with PrefixCache(llama, config(fast_dir), model_id="t") as pc:
        ssd = pc.tiers.named("ssd")
        for tokens in requests(150):
            serve(pc, llama, tokens)
        ssd.flush()  # the writer's queue only; hot is not flushed
        num, unreachable = detached(ssd)
        assert pc.stats()["num_spills"] > 0 and num > 0
        assert unreachable == 0, f"{unreachable} of {num} blocks on disk lack their parent"
