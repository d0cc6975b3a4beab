"""A restore's copies on a few threads (copies.py): large restores of large pieces
copy on the pool, small ones on the caller's thread, and either gives the bytes
that were stored."""

from __future__ import annotations

import os
import signal
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models.cache import KVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs import buffer
from prefixcache.copies import MIN_PIECE, PARALLEL_BYTES, Copies

MiB = 1 << 20


def _names(copies: Copies, jobs: int, nbytes: int, pieces: int = 1) -> set[str]:
    """Thread names the ``jobs`` ran on, each said to copy ``nbytes`` in ``pieces``."""
    seen: set[str] = set()
    lock = threading.Lock()

    def job() -> None:
        with lock:
            seen.add(threading.current_thread().name)

    for _ in range(jobs):
        copies.add(nbytes, job, pieces)
    copies.wait()
    return seen


def test_large_copies_run_on_the_pool_and_small_ones_on_the_caller(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "2")
    big = _names(Copies(), 8, PARALLEL_BYTES // 2)
    assert any(n.startswith("prefixcache-copy") for n in big), big
    assert "MainThread" not in big, big  # held jobs go to the pool once over the bar
    # the controls: too few bytes, too many small pieces, one thread asked for
    assert _names(Copies(), 8, PARALLEL_BYTES // 64) == {"MainThread"}
    small_pieces = PARALLEL_BYTES // 2 // (MIN_PIECE // 4)
    assert _names(Copies(), 8, PARALLEL_BYTES // 2, small_pieces) == {"MainThread"}
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "1")
    assert _names(Copies(), 8, PARALLEL_BYTES // 2) == {"MainThread"}


def test_wait_raises_a_jobs_error_after_every_job_ended(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "2")
    copies, done, gate = Copies(), [], threading.Event()

    def slow() -> None:
        gate.wait(5)
        done.append(1)

    def bad() -> None:
        gate.set()
        raise ValueError("bad piece")

    copies.add(PARALLEL_BYTES, slow)
    copies.add(PARALLEL_BYTES, bad)
    copies.add(PARALLEL_BYTES, slow)
    with pytest.raises(ValueError, match="bad piece"):
        copies.wait()
    assert done == [1, 1]


def test_a_forked_child_copies_on_a_pool_of_its_own(monkeypatch):
    """The parent's pool threads do not survive a fork: a child that copied through
    the parent's executor would wait forever. It makes its own pool (exit 0 within
    the deadline, its jobs seen on its pool's threads)."""
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "2")
    assert any(n.startswith("prefixcache-copy") for n in _names(Copies(), 8, PARALLEL_BYTES))
    pid = os.fork()
    if pid == 0:  # the child: numpy and threads only, no MLX
        code = 3
        try:
            names = _names(Copies(), 8, PARALLEL_BYTES)
            code = 0 if any(n.startswith("prefixcache-copy") for n in names) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copies did not finish in 30 s")


@pytest.mark.parametrize("raw", ["0", "two"])
def test_a_bad_thread_count_is_named(monkeypatch, raw):
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", raw)
    with pytest.raises(ValueError, match=f"PREFIXCACHE_COPY_THREADS.*{raw}"):
        Copies()


@pytest.mark.parametrize("threads", ["2", "1"])
def test_a_large_hot_restore_gives_the_stored_bytes(monkeypatch, threads):
    """2 layers x 8 kv heads x 128 dims, bf16, 2048 tokens at block 256: 16 MiB in
    512 KiB pieces, copied on the pool (threads=2: seen on its threads) or on the
    caller (the control). Every restored byte equals the stored one, and a
    changed byte is seen (the comparison can fail)."""
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", threads)
    seen: set[str] = set()
    copy_run = buffer._copy_run

    def watched(host, run, start, end):
        seen.add(threading.current_thread().name)
        return copy_run(host, run, start, end)

    monkeypatch.setattr(buffer, "_copy_run", watched)
    model = tiny_model(
        dtype=mx.bfloat16,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
    )
    tokens = np.random.default_rng(0).integers(0, 512, 2048).tolist()
    stored = []
    for _ in range(2):
        c = KVCache()
        shape = (1, 8, 2048, 128)
        c.update_and_fetch(
            mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16)
        )
        stored.append(c)
    mx.eval([c.state for c in stored])
    config = CacheConfig(block_size=256, hot_cache_only=True, hot_max_bytes=1 << 30)
    with PrefixCache(model, config, model_id="copies") as pc:
        pc.store(tokens, stored)
        cache, num = pc.fetch([*tokens, 1])
    assert num == 2048
    on_pool = any(n.startswith("prefixcache-copy") for n in seen)
    assert on_pool == (threads == "2"), seen
    for got, want in zip(cache, stored, strict=True):
        assert got.offset == 2048 and got.keys.shape[2] > 2048
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            host = np.array(a.view(mx.uint16))
            assert np.array_equal(host[:, :, :2048], np.array(b.view(mx.uint16)))
    flipped = np.array(cache[1].values.view(mx.uint16))
    flipped[0, 7, 2047, 127] ^= 1
    assert not np.array_equal(flipped[:, :, :2048], np.array(stored[1].values.view(mx.uint16)))
