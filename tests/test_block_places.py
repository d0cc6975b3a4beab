"""A run file tensor's rows read into their blocks' regions, the pieces between hashed.

A file holding one tensor of 64 (batch, head) rows, each 16 blocks of 4 KiB of
random bytes, is read with real ``preadv`` calls for a job of blocks 2 to 13
whose blocks 4-6 share one region and block 9 has its own (the others no
place): each region gets exactly its blocks' bytes of every row, the pieces
between are read through the scratch in the same batches (no read of their
own), batches past the first reuse the scratch, and the whole file's checksum
holds. The control: a byte flipped in a piece only hashed fails the check.
"""

from __future__ import annotations

import os
import queue

import numpy as np
import pytest
import xxhash

from prefixcache.errors import PayloadError
from prefixcache.tiers.ssd.block_places import add_rows
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
