"""Remote parts into their places: each part's bytes are copied once, straight to
where the restore wants them, and hashed on the way.

A block's payload is its tensors' bytes back to back. The restore offers each
tensor a destination (``place``: the contiguous runs of the restore buffer it
belongs in, as for the SSD stream); a tensor without one goes into a host
buffer of the block's own. :class:`Targets` lays those runs end to end, so
that every payload offset falls in exactly one run, and ``receive`` reads a
part's reply off the socket into the runs in slices of at most ``_SLICE``
bytes, hashing each slice right after it arrived, while it is still in the
CPU cache: one copy (the kernel's, socket to destination) and one hash pass,
no intermediate buffer. A tensor the restore does not read is received into one
small scratch, slice over slice, and hashed there. The part's checksum is checked at the end: a part
that fails has written some of its bytes already, so the block is a miss and
the restore stops before it.

With ``remote_secret`` a part's bytes must pass their MAC before a byte reaches
a restore buffer: they are read into a staging buffer of one part (reused
across parts and blocks), MAC'd slice by slice on a MAC thread while the next
slice arrives, verified, and only then copied into their runs: one copy more
than without a secret.
"""

from __future__ import annotations

import queue
import threading
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from ...errors import PayloadError
from ...memory.host import MX_DTYPES, UNNEEDED, HostArray, Place, Placed, contiguous
from ...memory.pools import SharedPool
from .format import (
    PART_BYTES,
    PART_HEAD_BYTES,
    Names,
    RemoteMeta,
    bad_bytes,
    part_digest,
    spec_bytes,
)
from .seal import Hasher, digest_of, part_hasher, same_digest
from .wire import Replies

# Read and hash in slices that stay in the CPU cache between the two passes.
_SLICE = 256 << 10


@dataclass(frozen=True, slots=True)
class Targets:
    """Where a block's payload bytes go, in payload order."""

    arrays: dict[str, HostArray | Placed]  # what the restore gets for each tensor
    runs: list[memoryview]  # the destinations of the payload, end to end ('B' format)
    starts: list[int]  # the payload offset of each run


def targets(meta: RemoteMeta, place: Place | None) -> Targets:
    """The destinations of block ``meta``'s payload: each tensor's place (its
    size must match), else a slice of one new host buffer. A tensor no layer of
    the restore reads (``UNNEEDED``) is received through one small scratch,
    hashed and dropped: left out of the block, as the SSD readers leave it."""
    sizes = [spec_bytes(s) for s in meta.specs]
    dests: list[np.ndarray | None] = []
    for (name, dtype, shape), size in zip(meta.specs, sizes, strict=True):
        dest = place(meta.index, name, MX_DTYPES[dtype], shape) if place is not None else None
        fits = dest is UNNEEDED or (dest is not None and dest.nbytes == size)
        dests.append(dest if fits else None)
    loose = sum(size for size, dest in zip(sizes, dests, strict=True) if dest is None)
    buf = np.empty(loose, np.uint8) if loose else None
    skipped = max((size for size, d in zip(sizes, dests, strict=True) if d is UNNEEDED), default=0)
    scratch = memoryview(np.empty(min(skipped, _SLICE), np.uint8)) if skipped else None
    arrays: dict[str, HostArray | Placed] = {}
    into: list[memoryview] = []
    used = 0
    for (name, dtype, shape), size, dest in zip(meta.specs, sizes, dests, strict=True):
        if dest is UNNEEDED:  # every slice into the same scratch: hashed as it arrives
            if size:
                assert scratch is not None
                into += [scratch[: min(_SLICE, size - at)] for at in range(0, size, _SLICE)]
            continue
        if dest is None:
            assert buf is not None or size == 0
            data = buf[used : used + size] if buf is not None else np.empty(0, np.uint8)
            used += size
            arrays[name] = HostArray(data, MX_DTYPES[dtype], shape)
            dest = data
        else:
            arrays[name] = Placed(dest, MX_DTYPES[dtype], shape)
        into += contiguous(dest)
    starts = np.cumsum([0] + [r.nbytes for r in into[:-1]]).tolist() if into else []
    return Targets(arrays, into, starts)


def receive(into: Targets, meta: RemoteMeta, names: Names, n: int, replies: Replies) -> bool:
    """Read part ``n`` of block ``meta`` from ``replies`` into its runs and verify
    it: its header names this block, part and count, and the digest of its
    bytes (xxh3-128, or its MAC with a secret) matches both its header and the
    meta. False: the part is missing.

    Raises:
        Forged: with a secret, a plain part or bytes that fail their MAC.
        PayloadError: another block's or version's part, torn, or a bad checksum.
    """
    length = replies.length()
    if length is None:
        return False
    if length < PART_HEAD_BYTES:
        raise PayloadError(f"remote part {n} of {meta.key.hex()} is truncated")
    size = length - PART_HEAD_BYTES
    digest = part_digest(meta, names, n, replies.read(PART_HEAD_BYTES), size)
    if names.seal is not None:
        return _receive_signed(into, meta, names, n, replies, size, digest)
    hasher = part_hasher(None, meta.key, n, meta.num_parts)
    offset, done = n * PART_BYTES, 0
    r = bisect_right(into.starts, offset) - 1
    while done < size:  # straight into place, hashed while in the CPU cache
        run = into.runs[r]
        at = offset + done - into.starts[r]
        take = min(size - done, run.nbytes - at, _SLICE)
        dest = run[at : at + take]
        replies.read_into(dest)
        hasher.update(dest)
        done += take
        if at + take == run.nbytes:
            r += 1
    replies.end()
    if not same_digest(digest_of(hasher), digest):
        raise bad_bytes(meta, names, n)
    return True


def _receive_signed(
    into: Targets,
    meta: RemoteMeta,
    names: Names,
    n: int,
    replies: Replies,
    size: int,
    digest: bytes,
) -> bool:
    """Part ``n`` read into the staging buffer, MAC'd there slice by slice on a MAC
    thread while the next slice arrives, verified, and only then copied into place."""
    staged = _staging(size)
    slices: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    mac = _MACS.get().submit(_mac, part_hasher(names.seal, meta.key, n, meta.num_parts), slices)
    try:
        for done in range(0, size, _SLICE):
            view = staged[done : min(size, done + _SLICE)]
            replies.read_into(view)
            slices.put(view)
    finally:
        slices.put(None)  # the MAC thread always ends, whatever happened here
    replies.end()
    if not same_digest(mac.result(), digest):
        raise bad_bytes(meta, names, n)
    _scatter(into, n * PART_BYTES, staged[:size])  # verified: now into place
    return True


# HMAC-SHA256 releases the GIL on large updates: a MAC thread hashes one slice
# while the reader's thread receives the next (one per part being received)
_MACS = SharedPool(4, "prefixcache-remote-mac")


def _mac(hasher: Hasher, slices: queue.SimpleQueue[memoryview | None]) -> bytes:
    while (view := slices.get()) is not None:
        hasher.update(view)
    return digest_of(hasher)


def _scatter(into: Targets, offset: int, data: memoryview) -> None:
    """Copy ``data`` (payload bytes from ``offset``) into its runs."""
    r = bisect_right(into.starts, offset) - 1
    done = 0
    while done < data.nbytes:
        run = into.runs[r]
        at = offset + done - into.starts[r]
        take = min(data.nbytes - done, run.nbytes - at)
        run[at : at + take] = data[done : done + take]
        done += take
        r += 1


_STAGING = threading.local()


def _staging(size: int) -> memoryview:
    """This thread's staging buffer of at least ``size`` bytes (one part, reused)."""
    buf = getattr(_STAGING, "buf", None)
    if buf is None or buf.nbytes < size:
        buf = _STAGING.buf = memoryview(np.empty(max(size, PART_BYTES), np.uint8)).cast("B")
    return buf
