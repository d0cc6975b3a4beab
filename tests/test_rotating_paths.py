"""A sliding-window layer rebuilt through every way its blocks arrive gives the same cache.

RotatingBuilder takes MLX arrays (``add``), a hot tier's blocks as host views
(``add_resident``), streamed host bytes (``add`` of HostArrays) and tensors a
reader wrote straight into its buffers (``reserve``, ``destination``, then
``add`` of Placed ones). Over windows, ``keep`` tokens, block sizes and
lengths (a last block cut back included), each rebuilt cache must update like
a cache prefilled live to the same length; the control: a block whose values
are changed on the way in gives other restored tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

from prefixcache.codecs import codec_for
from prefixcache.codecs.base import round_up
from prefixcache.memory.copies import Copies
from prefixcache.memory.host import HostArray, Placed, host_bytes

PATHS = ["mx", "resident", "host", "placed"]


def positions(start: int, end: int, heads: int = 2, dim: int = 3) -> mx.array:
    """(1, heads, end - start, dim) K/V whose values encode (head, position)."""
    pos = mx.arange(start, end, dtype=mx.float32)[None, None, :, None]
    head = mx.arange(heads, dtype=mx.float32)[None, :, None, None] * 1000
    return mx.broadcast_to(pos + head, (1, heads, end - start, dim)) + 0


def host(x: mx.array) -> HostArray:
    return HostArray(np.frombuffer(bytes(memoryview(x)), np.uint8).copy(), x.dtype, x.shape)


def rebuild(path: str, fresh, blocks: dict, num_tokens: int, block: int) -> RotatingKVCache:
    """``fresh`` rebuilt from ``blocks`` (index -> {keys, values}) through ``path``,
    in the order a restore calls the builder."""
    codec = codec_for(fresh)
    needed = list(codec.blocks_needed(fresh, num_tokens, block))
    b = codec.builder(fresh, num_tokens, round_up(num_tokens + 1), block)
    if path == "resident":
        resident = [
            (
                {f"0.{n}": a for n, a in blocks[i].items()},
                {f"0.{n}": host_bytes(a) for n, a in blocks[i].items()},
            )
            for i in needed
        ]
        assert b.add_resident(needed, resident, "0.")
    elif path == "placed":
        first = blocks[needed[0]]
        mx.eval(b.reserve(needed[0], {n: Placed(None, a.dtype, a.shape) for n, a in first.items()}))
        b.buffers()
        for i in needed:
            arrays = {}
            for name, x in blocks[i].items():
                region = b.destination(i, name, x.dtype, x.shape)
                if region is None:
                    arrays[name] = host(x)
                    continue
                region[...] = host(x).rows()  # as a reader thread writes it
                arrays[name] = Placed(region, x.dtype, x.shape)
            b.add(i, arrays)
    else:
        for i in needed:
            b.add(i, {n: host(a) if path == "host" else a for n, a in blocks[i].items()})
    mx.eval(b.allocate())
    copies = Copies()
    b.queue_copies(copies)
    copies.wait()
    return b.finish()


@settings(max_examples=120, deadline=None)
@given(
    window=st.integers(3, 40),
    keep=st.sampled_from([0, 0, 1, 4]),
    block=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(1, 14),
    short=st.integers(0, 7),
    nxt=st.integers(1, 9),
)
def test_every_path_rebuilds_the_live_window(window, keep, block, num_blocks, short, nxt):
    assume(keep < window)
    stored = num_blocks * block
    num_tokens = stored - min(short, block - 1)  # the last block cut back by ``short``
    codec = codec_for(RotatingKVCache(window))
    ring = RotatingKVCache(window, keep)
    ring.update_and_fetch(positions(0, stored), positions(0, stored))  # one chunk: all held
    blocks = {
        i: codec.cut(ring, i * block, (i + 1) * block, length=stored) for i in range(num_blocks)
    }
    reference = RotatingKVCache(window, keep)
    reference.update_and_fetch(positions(0, num_tokens), positions(0, num_tokens))
    new = positions(num_tokens, num_tokens + nxt)
    want = reference.update_and_fetch(new, new)
    held = {}  # path -> the tokens its restored buffer holds, before the update
    for path in PATHS:
        restored = rebuild(path, RotatingKVCache(window, keep), blocks, num_tokens, block)
        assert restored.offset == num_tokens, path
        held[path] = restored.keys[..., : restored._idx, :]
        got = restored.update_and_fetch(new, new)
        assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1]), path

    # the control: the window's last block changed on its way in shows in the restored
    # tokens (an update may drop it from what it returns: keep 4 of a 5-token window)
    last = num_blocks - 1
    bad = {**blocks, last: {n: a + 1 for n, a in blocks[last].items()}}
    for path in PATHS:
        restored = rebuild(path, RotatingKVCache(window, keep), bad, num_tokens, block)
        assert not mx.array_equal(restored.keys[..., : restored._idx, :], held[path]), path
