"""A small hot restore's buffer (built in host memory): every segment's values,
in the model's dtype, at its tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from prefixcache.codecs import buffer
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.host import host_bytes

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
    assert out.nbytes < buffer._SMALL
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
