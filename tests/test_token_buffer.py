"""A small hot restore's buffer (built in host memory): every segment's values,
in the model's dtype, at its tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from prefixcache.codecs import buffer
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.errors import LayoutMismatchError
from prefixcache.memory.copies import Copies
from prefixcache.memory.host import host_bytes

SEG = (1, 2, 16, 8)  # (B, heads, block tokens, head dim)


def segments(dtype: mx.Dtype, n: int) -> list[mx.array]:
    out = [mx.random.normal(SEG, key=mx.random.key(k)).astype(dtype) for k in range(n)]
    mx.eval(out)
    return out


def built(parts: list[mx.array], starts: list[int], capacity: int) -> mx.array:
    buf = TokenBuffer(capacity)
    buf.add_run([(s, x, host_bytes(x)) for s, x in zip(starts, parts, strict=True)])
    assert buf.allocate() == []  # small: built by finish, in host memory
    out = buf.finish()
    mx.eval(out)
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_small_buffer_holds_every_segment_in_its_dtype(dtype):
    parts = segments(dtype, 5)
    n = SEG[2]
    out = built(parts, [k * n for k in range(5)], 96)
    assert out.dtype == dtype and out.shape == (1, 2, 96, 8)
    assert out.nbytes < buffer.SMALL
    assert mx.array_equal(out[:, :, : 5 * n, :], mx.concatenate(parts, axis=2)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_negative_control_segments_at_swapped_tokens_differ(dtype):
    """The comparison above can fail: two segments placed at each other's tokens."""
    parts = segments(dtype, 5)
    n = SEG[2]
    starts = [k * n for k in range(5)]
    starts[1], starts[3] = starts[3], starts[1]
    out = built(parts, starts, 96)
    assert not mx.array_equal(out[:, :, : 5 * n, :], mx.concatenate(parts, axis=2)).item()


def _from_views(capacity: int, runs: list[tuple[int, int, list[mx.array]]]) -> mx.array:
    buf = TokenBuffer(capacity)
    for start, end, parts in runs:
        buf.add_views(start, end, parts[0], [host_bytes(x) for x in parts])
    copies = Copies()
    mx.eval(buf.allocate())
    buf.queue_copies(copies)
    copies.wait()
    out = buf.finish()
    mx.eval(out)
    return out


@pytest.mark.parametrize("capacity", [96, 1 << 16])  # built in host memory, and a large one
def test_a_run_of_views_holds_what_its_segments_hold(capacity):
    """``add_views`` (one entry for a run of hot segments) gives the segments'
    bytes at their tokens, with a short last segment (a chain's partial tail) and
    another run after it. Controls: two segments swapped give other bytes; a
    short segment mid-run (the span as a builder computes it: whole blocks but
    the last) does not fill its span and is refused."""
    parts = segments(mx.bfloat16, 6)
    tail = parts[4][:, :, :5, :]  # 5 tokens
    mx.eval(tail)
    n = SEG[2]
    first = [*parts[:4], tail]
    out = _from_views(capacity, [(0, 4 * n + 5, first), (4 * n + 5, 5 * n + 5, parts[5:])])
    want = mx.concatenate([*first, parts[5]], axis=2)
    assert mx.array_equal(out[:, :, : 5 * n + 5, :], want).item()
    swapped = _from_views(capacity, [(0, 4 * n + 5, [parts[1], parts[0], *first[2:]])])
    assert not mx.array_equal(swapped[:, :, : 4 * n + 5, :], want[:, :, : 4 * n + 5]).item()
    short_mid = [*parts[:3], tail, parts[3]]
    with pytest.raises(LayoutMismatchError):
        _from_views(capacity, [(0, 4 * n + short_mid[-1].shape[2], short_mid)])


def test_a_run_of_views_outside_the_buffer_is_refused():
    parts = segments(mx.float32, 2)
    buf = TokenBuffer(16)
    with pytest.raises(LayoutMismatchError, match="outside 16"):
        buf.add_views(0, 32, parts[0], [host_bytes(x) for x in parts])


def test_a_run_of_views_into_an_open_buffer():
    """A buffer already opened (a first run materialized) takes a later run of
    views too: both runs' bytes at their tokens."""
    parts = segments(mx.float32, 4)
    n = SEG[2]
    buf = TokenBuffer(1 << 16)
    buf.add_views(0, 2 * n, parts[0], [host_bytes(x) for x in parts[:2]])
    buf.materialize()  # opens the buffer and copies the first run
    buf.add_views(2 * n, 4 * n, parts[2], [host_bytes(x) for x in parts[2:]])
    out = buf.finish()
    mx.eval(out)
    assert mx.array_equal(out[:, :, : 4 * n, :], mx.concatenate(parts, axis=2)).item()
