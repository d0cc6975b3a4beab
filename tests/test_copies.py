"""A restore's copies on a few threads (copies.py): a large restore's copies are
taken by the caller's thread and the pool's together, each job once, a small
one's stay on the caller's thread, and either gives the bytes that were stored."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models.cache import KVCache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs import buffer
from prefixcache.memory import copies
from prefixcache.memory.copies import MIN_PIECE, PARALLEL_BYTES, Copies

MiB = 1 << 20


def _names(
    copies: Copies, jobs: int, nbytes: int, meet: int = 1, timeout: float = 5, pieces: int = 1
) -> set[str]:
    """Thread names the ``jobs`` ran on, each said to copy ``nbytes`` from ``pieces``
    arrays (each job once, checked). ``meet``: that many threads must take a job,
    each holding its first until all have one (else the barrier breaks and ``wait``
    raises), so a caller quick enough to take every job alone cannot hide the pool."""
    seen: dict[str, int] = {}
    ran: list[int] = []
    lock = threading.Lock()
    meeting = threading.Barrier(meet, timeout=timeout)

    def job(i: int) -> None:
        with lock:
            name = threading.current_thread().name
            first = name not in seen
            seen[name] = seen.get(name, 0) + 1
            ran.append(i)
        if first and meet > 1:
            meeting.wait()

    for i in range(jobs):
        copies.add(nbytes, partial(job, i), pieces)
    copies.wait()
    assert sorted(ran) == list(range(jobs))  # every job, once
    return set(seen)


def test_large_copies_run_on_the_caller_and_the_pool(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "2")
    names = _names(Copies(), 8, PARALLEL_BYTES // 2, meet=2)
    assert "MainThread" in names and any(n.startswith("prefixcache-copy") for n in names)
    # the controls: too few bytes, too small pieces, one thread asked for (a meeting
    # would break there)
    assert _names(Copies(), 8, PARALLEL_BYTES // 64) == {"MainThread"}
    small = PARALLEL_BYTES // 2 // (MIN_PIECE // 2)  # pieces of half MIN_PIECE
    assert _names(Copies(), 8, PARALLEL_BYTES // 2, pieces=small) == {"MainThread"}
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "1")
    assert _names(Copies(), 8, PARALLEL_BYTES // 2) == {"MainThread"}
    with pytest.raises(threading.BrokenBarrierError):
        _names(Copies(), 8, PARALLEL_BYTES // 2, meet=2, timeout=0.3)


def test_fewer_jobs_than_threads_share_the_one_pool(monkeypatch):
    """A restore of fewer jobs than threads takes fewer of the same pool's threads: no
    pool of its own per job count (the control: a thread count asked for anew gets
    its pool)."""
    monkeypatch.setattr(copies, "_pools", {})
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "3")
    names = _names(Copies(), 2, PARALLEL_BYTES, meet=2)  # one helper of the 3-thread pool
    assert any(n.startswith("prefixcache-copy") for n in names)
    _names(Copies(), 6, PARALLEL_BYTES, meet=3)
    assert list(copies._pools) == [2]  # helpers: the caller copies too
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", "2")
    _names(Copies(), 4, PARALLEL_BYTES, meet=2)
    assert sorted(copies._pools) == [1, 2]


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
    assert any(n.startswith("prefixcache-copy") for n in _names(Copies(), 8, PARALLEL_BYTES, 2))
    pid = os.fork()
    if pid == 0:  # the child: numpy and threads only, no MLX
        code = 3
        try:
            names = _names(Copies(), 8, PARALLEL_BYTES, 2)
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
    512 KiB pieces, copied by the caller and the pool (threads=2: each holds its
    first copy until the other has one, so both are seen) or by the caller alone
    (the control). Every restored byte equals the stored one, and a changed byte
    is seen (the comparison can fail)."""
    monkeypatch.setenv("PREFIXCACHE_COPY_THREADS", threads)
    seen: set[str] = set()
    copy_run = buffer._copy_run
    meeting = threading.Barrier(int(threads), timeout=5)

    def watched(host, run, start, end):
        name = threading.current_thread().name
        if name not in seen:
            seen.add(name)
            meeting.wait()
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
