"""A run file tensor's rows read into their blocks' regions, the pieces between hashed.

A file holding one tensor of 64 (batch, head) rows, each 16 blocks of 4 KiB of
random bytes, is read with real ``preadv`` calls for a job of blocks 2 to 13
whose blocks 4-6 share one region and block 9 has its own (the others no
place): each region gets exactly its blocks' bytes of every row, the pieces
between are read through the scratch in the same batches (no read of their
own), batches past the first reuse the scratch, and the whole file's checksum
holds. The control: a byte flipped in a piece only hashed fails the check.

``BlockPlaces`` asks a ``Place`` (here one over a numpy buffer, as a restore's
answers: a region for blocks its layer uses, UNNEEDED for none, None for some)
block by block: a window's blocks go into one region asked for all of them, a
place that gives none for several blocks gets one piece per block, each block
its own bytes; a block with no place leaves the tensor to the loose buffer.
"""

from __future__ import annotations

import os
import queue

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from prefixcache.errors import PayloadError
from prefixcache.memory.host import UNNEEDED, Placed
from prefixcache.tiers.ssd.block_places import BlockPlaces, add_rows
from prefixcache.tiers.ssd.checked import Steps, read_checked
from prefixcache.tiers.ssd.large import region_rows
from prefixcache.tiers.ssd.read_into import Buffers

ROWS, K, PIECE = 64, 16, 4096  # 4 MiB: several batches of at most 1 MiB
J, M = 2, 12  # the job: blocks 2 to 13 of the file


def read_parts(tmp_path, flip: int | None = None):
    """(the file's rows, the regions of blocks 4-6 and 9 after the read, its steps)."""
    data = np.random.default_rng(0).integers(0, 256, (ROWS, K, PIECE), dtype=np.uint8)
    checksum = xxhash.xxh3_64_intdigest(data.tobytes())
    raw = bytearray(data.tobytes())
    if flip is not None:
        raw[flip] ^= 0xFF
    path = tmp_path / "tensor"
    path.write_bytes(bytes(raw))
    shared, own = np.zeros((1, ROWS, 3, PIECE), np.uint8), np.zeros((1, ROWS, 1, PIECE), np.uint8)
    bufs = Buffers(queue.SimpleQueue())
    steps = Steps(bufs)
    parts = [(2, 3, shared, region_rows(shared)), (7, 1, own, region_rows(own))]
    add_rows(steps, parts, PIECE, J, K, M)
    done = steps.done()
    fd = os.open(path, os.O_RDONLY)
    try:
        read_checked(fd, done, b"", checksum, bufs)
    finally:
        os.close(fd)
    return data, shared, own, done


def test_each_region_gets_its_blocks_and_the_pieces_between_are_hashed_in_batch(tmp_path):
    data, shared, own, steps = read_parts(tmp_path)
    assert np.array_equal(shared[0], data[:, 4:7])
    assert np.array_equal(own[0, :, 0], data[:, 9])
    assert all(type(s) is tuple for s in steps)  # no read only to hash
    assert len(steps) <= ROWS // 4, len(steps)  # not a read per row, nor two
    views = [v for batch, _ in steps for v in batch]
    gaps = [v for v in views if not np.shares_memory(v, shared) and not np.shares_memory(v, own)]
    assert len(views) - len(gaps) == 2 * ROWS  # a view per row into each region
    # 3 MiB of gaps read through one smaller scratch: each batch reuses it
    assert sum(v.nbytes for v in gaps) == ROWS * (K - 4) * PIECE > gaps[0].base.nbytes
    assert all(v.base is gaps[0].base for v in gaps)


@pytest.mark.parametrize("block", [0, 3, 15], ids=["before-the-job", "in-the-job", "after-it"])
def test_a_byte_flipped_in_a_piece_only_hashed_fails_the_check(tmp_path, block):
    at = (10 * K + block) * PIECE + 7  # row 10
    with pytest.raises(PayloadError):
        read_parts(tmp_path, flip=at)


H, N, D = 8, 4, 64  # heads, tokens and bytes a token: a block's piece of a row is 256 bytes
CASES = {  # the job's blocks its layer uses, whether its place gives a region for several
    "window": ({10, 11, 12, 13}, True),
    "keep-and-window-block-by-block": ({2, 3, 11, 12, 13}, False),
    "one-block": ({13}, True),
}


def place_over(buf: np.ndarray, used: set[int], runs: bool, missing: frozenset = frozenset()):
    """A restore's ``Place`` of one layer that uses blocks ``used`` of a buffer holding
    block i at tokens [i * N, (i + 1) * N): None for blocks ``missing`` (no buffer)."""

    def place(index, name, dtype, shape, count=1):
        blocks = set(range(index, index + count))
        if blocks.isdisjoint(used):
            return UNNEEDED
        if not blocks <= used or blocks & missing or (count > 1 and not runs):
            return None
        return buf[:, :, index * N : (index + count) * N, :]

    return place


def take(tmp_path, used: set[int], runs: bool, missing: frozenset = frozenset()):
    """(the file's tensor (1, H, K, N, D), the buffer, the BlockPlaces, its answer)."""
    data = np.random.default_rng(1).integers(0, 256, (1, H, K, N, D), dtype=np.uint8)
    path = tmp_path / "tensor"
    path.write_bytes(data.tobytes())
    buf = np.zeros((1, H, K * N, D), np.uint8)
    places = BlockPlaces(place_over(buf, used, runs, missing), J, J, K, M)
    bufs = Buffers(queue.SimpleQueue())
    steps = Steps(bufs)
    span = ("0.keys", "U8", (1, H, K * N, D), 0, data.nbytes)
    taken = places.take(span, mx.uint8, (1, H, N, D), steps)
    if taken is None:  # read loose by the caller
        return data, buf, places, taken
    fd = os.open(path, os.O_RDONLY)
    try:
        read_checked(fd, steps.done(), b"", xxhash.xxh3_64_intdigest(data.tobytes()), bufs)
    finally:
        os.close(fd)
    return data, buf, places, taken


@pytest.mark.parametrize("case", list(CASES))
def test_each_block_used_gets_its_bytes_in_its_place(tmp_path, case):
    used, runs = CASES[case]
    data, buf, places, taken = take(tmp_path, used, runs)
    assert taken is True
    for i in range(J, J + M):
        got = places.of("0.keys", i - J)
        if i not in used:
            assert got is None and not buf[:, :, i * N : (i + 1) * N].any()
            continue
        assert type(got) is Placed and got.shape == (1, H, N, D)
        assert np.array_equal(got.region, data[:, :, i])  # its own bytes, in its place
        assert np.shares_memory(got.region, buf[:, :, i * N : (i + 1) * N])


def test_a_block_without_a_place_leaves_the_tensor_to_the_loose_buffer(tmp_path):
    _, buf, places, taken = take(tmp_path, {10, 11, 12, 13}, True, missing=frozenset({12}))
    assert taken is None and places.placed == {} and not buf.any()


def test_a_region_s_rows_are_views_of_its_buffer_in_batch_then_head_order():
    """``region_rows`` of a run region (a token-axis slice of a restore buffer): each
    (batch, head) row is a view of exactly that row's bytes, so a read into it lands
    in the buffer; a region whose rows are not contiguous has none."""
    buf = np.zeros((2, 3, 40, 8), np.uint8)
    region = buf[:, :, 16:24, :]
    rows = region_rows(region)
    assert rows is not None and len(rows) == 6
    for r, row in enumerate(rows):
        i, k = divmod(r, 3)
        assert row.shape == (64,) and np.shares_memory(row, buf)
        row[:] = r + 1
        assert (buf[i, k, 16:24] == r + 1).all()
    assert (buf[:, :, :16] == 0).all() and (buf[:, :, 24:] == 0).all()  # nothing outside
    # every other head: no one reshape is a view of those rows, each row is still one
    rows = region_rows(buf[:, ::2, 30:32, :])
    assert rows is not None and len(rows) == 4
    for r, row in enumerate(rows):
        row[:] = 100 + r
        assert (buf[r // 2, 2 * (r % 2), 30:32] == 100 + r).all()
    assert (buf[:, 1, 30:32] == 0).all()
    assert region_rows(buf[:, :, :, 2:6]) is None  # the control: rows not contiguous
