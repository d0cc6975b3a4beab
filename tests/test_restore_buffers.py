"""restore_buffers.empty: restore buffers MLX allocates without writing, and TokenBuffer's
zeroing of what no block wrote."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from prefixcache import restore_buffers
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.host import HostArray

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.uint32, mx.int8])
def test_empty_has_the_shape_and_dtype_and_takes_writes(dtype):
    a = restore_buffers.empty((1, 3, 5, 7), dtype)
    mx.eval(a)
    assert a.shape == (1, 3, 5, 7) and a.dtype == dtype
    view = np.asarray(memoryview(a).cast("B"))
    view[...] = 1
    assert np.all(np.asarray(memoryview(a).cast("B")) == 1)


def test_empty_of_nothing_or_an_unknown_dtype_is_zeros():
    assert restore_buffers.empty((1, 0, 4), mx.float16).shape == (1, 0, 4)
    c = restore_buffers.empty((2, 2), mx.complex64)
    assert c.dtype == mx.complex64 and not mx.any(c).item()


def _rss_growth(make) -> int:
    """How much RSS an evaluated ``make()`` adds, from an empty MLX buffer cache."""
    mx.clear_cache()
    before = rss()
    a = make()
    mx.eval(a)
    grown = rss() - before
    del a
    mx.clear_cache()
    return grown


def test_empty_leaves_fresh_pages_untouched():
    """The point of it: 256 MiB of fresh memory is not faulted in (mx.zeros, the
    control, faults in all of it)."""
    shape, size = (1, 8, 128 * 1024, 128), 256 * MiB
    grown_empty = _rss_growth(lambda: restore_buffers.empty(shape, mx.bfloat16))
    grown_zeros = _rss_growth(lambda: mx.zeros(shape, mx.bfloat16))
    assert grown_empty < 16 * MiB, grown_empty
    assert grown_zeros > 0.9 * size, grown_zeros


def test_empty_keeps_a_reused_buffers_bytes(keep_freed_buffers):
    """A buffer MLX hands back from its cache is not rewritten: the old bytes show."""
    shape = (1, 4, 1024, 64)
    old = mx.full(shape, 7, mx.int8)
    mx.eval(old)
    del old
    a = restore_buffers.empty(shape, mx.int8)
    mx.eval(a)
    assert np.all(np.asarray(a) == 7)


def test_finish_zeroes_the_headroom_of_a_reused_buffer(keep_freed_buffers):
    """Blocks fill tokens [0, 8); the rest of a buffer that held old bytes is zero
    after finish(), and only after it (the control: materialize() still shows them)."""
    # 2 MiB: above the size a restore takes zeros for (small buffers are not reused)
    capacity, rows = 4096, (1, 2, 4, 128)
    old = mx.full((1, 2, capacity, 128), 0x5A5A, mx.uint16).view(mx.bfloat16)
    mx.eval(old)
    del old
    rng = np.random.default_rng(0)
    parts = [rng.integers(1, 1 << 15, rows, dtype=np.uint16) for _ in range(2)]
    buf = TokenBuffer(capacity)
    for i, p in enumerate(parts):
        arr = HostArray(p.reshape(-1).view(np.uint8), mx.bfloat16, p.shape)
        buf.reserve(arr)
        buf.add(4 * i, arr)
    before = np.array(buf.materialize().view(mx.uint16))
    assert np.all(before[:, :, 8:] == 0x5A5A)  # the control: old bytes until finish
    out = np.array(buf.finish().view(mx.uint16))
    np.testing.assert_array_equal(out[:, :, :8], np.concatenate(parts, axis=2))
    assert not out[:, :, 8:].any()


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except OSError:
        return None


def _huge_bytes_in(start: int, nbytes: int) -> int:
    """AnonHugePages of the mappings overlapping [start, start + nbytes)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + nbytes and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


_HUGE_CHILD = """
import mlx.core as mx, numpy as np, sys
sys.path.insert(0, {tests!r})
from test_restore_buffers import _huge_bytes_in
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.host import HostArray
rows = np.zeros((1, 16, 256, 128), np.uint16)
buf = TokenBuffer(8448)
buf.add(0, HostArray(rows.reshape(-1).view(np.uint8), mx.bfloat16, rows.shape))
host = np.asarray(memoryview(buf.finish()).cast("B"))
host[...] = 1  # as the readers' copies would
print(_huge_bytes_in(host.ctypes.data, host.nbytes))
"""


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs Linux THP in madvise mode")
@pytest.mark.parametrize("advise", [True, False])
def test_restore_buffers_get_huge_pages_when_advised(advise):
    """A 34 MiB restore buffer opened by TokenBuffer lies on 2 MiB pages once
    written; with PREFIXCACHE_HUGE_PAGES=0 (the control) it does not. In a fresh
    process: memory another allocation advised before keeps its advice."""
    env = {**os.environ, "PREFIXCACHE_HUGE_PAGES": "1" if advise else "0"}
    code = _HUGE_CHILD.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    huge = int(out.stdout.strip())
    assert (huge >= 16 * MiB) if advise else huge == 0, huge
