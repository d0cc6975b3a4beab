"""ssd_stream: verified zero-copy views, misses for bad blocks, queued blocks, early stop."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from ssd_child import block_key, check_block, make_block

from prefixcache.blocks import Block
from prefixcache.codecs.base import LayoutMismatchError
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.host import HostArray
from prefixcache.payload import payload_path
from prefixcache.ssd import SsdTier
from prefixcache.ssd_stream import StreamedBlock, stream


@pytest.fixture
def tier(tmp_path):
    t = SsdTier(str(tmp_path / "ssd"), max_bytes=1 << 30)
    yield t
    t.close()


def stored(tier: SsdTier, seed: int, n: int) -> list[bytes]:
    for i in range(n):
        assert tier.put(make_block(seed, i))
    tier.flush()
    return [block_key(seed, i) for i in range(n)]


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefixcache-ssd-read")]


def test_stream_yields_verified_views_in_chain_order(tier):
    keys = stored(tier, 1, 6)
    before = tier.stats()["num_loads"]
    got = []
    for block in stream(tier, keys):
        assert isinstance(block, StreamedBlock)
        assert all(isinstance(a, HostArray) for a in block.arrays.values())
        got.append(block.index)
        check_block(block.to_block())  # copied out while the view is valid
    assert got == list(range(6))
    assert tier.stats()["num_loads"] == before + 6
    assert not reader_threads()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_bad_payload_is_a_miss_and_quarantined(tier, damage):
    keys = stored(tier, 2, 5)
    path = payload_path(os.path.join(tier.path, "blocks"), keys[2])
    if damage == "delete":
        os.unlink(path)
    else:
        with open(path, "r+b") as f:
            if damage == "flip":
                f.seek(os.path.getsize(path) - 3)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            else:
                f.truncate(os.path.getsize(path) - 1)
    out = [b if b is None else b.to_block() for b in stream(tier, keys)]  # views: copy now
    assert out[2] is None
    for i in (0, 1, 3, 4):
        check_block(out[i])
    assert tier.stats()["num_corrupt"] == 1
    assert tier.get_meta(keys[2]) is None  # quarantined: never served again
    assert next(stream(tier, keys[2:3])) is None


def test_absent_keys_are_misses(tier):
    keys = stored(tier, 3, 2)
    out = list(stream(tier, [keys[0], block_key(3, 99), keys[1]]))
    assert out[1] is None and out[0] is not None and out[2] is not None
    assert tier.stats()["num_corrupt"] == 0


def test_a_block_still_queued_for_the_writer_is_served(tmp_path):
    hold = threading.Event()
    tier = SsdTier(str(tmp_path / "ssd"), max_bytes=1 << 30, writer_hold=hold)
    try:
        first = make_block(4, 0)
        assert tier.put(first)
        out = list(stream(tier, [first.key]))
        assert isinstance(out[0], Block)
        check_block(out[0])
        hold.set()
        tier.flush()
        check_block(next(stream(tier, [first.key])).to_block())
    finally:
        hold.set()
        tier.close()


def test_closing_early_stops_the_readers(tier):
    keys = stored(tier, 5, 8)
    gen = stream(tier, keys)
    check_block(next(gen).to_block())
    gen.close()
    assert not reader_threads()


def test_token_buffer_copies_host_arrays_in_place():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1 << 16, (1, 2, 4, 8), dtype=np.uint16) for _ in range(3)]
    host = [HostArray(p.reshape(-1).view(np.uint8), mx.bfloat16, p.shape) for p in parts]
    hot = mx.array(parts[1]).view(mx.bfloat16)
    buf = TokenBuffer(16)
    buf.add(0, host[0])
    buf.add(4, hot)  # an in-memory block between two streamed ones
    buf.add(8, host[2])
    out = np.array(buf.materialize().view(mx.uint16))
    assert out.shape == (1, 2, 16, 8)
    np.testing.assert_array_equal(out[:, :, :12], np.concatenate(parts, axis=2))
    assert not out[:, :, 12:].any()  # headroom is zero
    with pytest.raises(LayoutMismatchError):
        buf.add(12, HostArray(np.zeros(64, np.uint8), mx.bfloat16, (1, 1, 4, 8)))
