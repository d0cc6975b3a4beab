"""A large payload file read through the reader's scratch, a slice at a time.

Instead of scattering a file straight into its 2 x layers x heads pieces (an
iovec and a hash update each), its data go through the reader's reused
scratch in slices of whole tensors (``slices``): one ``preadv`` a slice, one
hash update, one numpy copy per tensor into its place (a block's strided piece
of the run's region), the GIL released for each. A file of up to
``WHOLE_BYTES`` of data is one slice, verified before any of its bytes is
placed; a longer one's earlier slices reach their places before the checksum
is known (the stream stops before such a block, as before any large file that
fails). A tensor no layer reads (``UNNEEDED``) is read and hashed only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from ...errors import PayloadError
from .read_into import Buffers, Span, preadv_all

# A file of up to this many data bytes is read whole (one slice): verified before
# any byte is placed, at about the CPU cost of 1 MiB slices. A longer one is read
# in slices of SLICE_BYTES, each still in the CPU's caches when it is hashed and
# copied out: a 32 MiB file through one 32 MiB buffer costs more (the scratch
# then comes back from memory for the copies).
WHOLE_BYTES = 8 << 20
SLICE_BYTES = 1 << 20

Target = np.ndarray | None  # where a tensor's bytes go; None: read and hashed only


def read_staged(
    fd: int,
    spans: Sequence[Span],
    targets: Sequence[Target],
    base: int,
    prefix: bytes,
    checksum: int,
    bufs: Buffers,
) -> None:
    """Read the file's data (from ``base``) slice by slice through the scratch,
    hash them (after ``prefix``, the header) and copy each tensor into its
    target (``targets[i]`` for ``spans[i]``: an array of the tensor's bytes,
    any strides). The whole file is checked against ``checksum``.

    Raises:
        PayloadError: a short read or a checksum mismatch.
    """
    hasher = xxhash.xxh3_64(prefix)
    for lo, hi in slices(spans):
        start, end = spans[lo][3], spans[hi - 1][4]
        data = bufs.scratch(end - start)
        if data.nbytes:
            preadv_all(fd, [data], base + start, data.nbytes)
        hasher.update(data)
        if lo == 0 and hi == len(spans) and hasher.intdigest() != checksum:
            raise PayloadError("payload checksum mismatch")  # one slice: nothing placed
        for span, target in zip(spans[lo:hi], targets[lo:hi], strict=True):
            if target is not None and target.nbytes:
                src = data[span[3] - start : span[4] - start]
                np.copyto(target, src.view(target.dtype).reshape(target.shape))
    if hasher.intdigest() != checksum:
        raise PayloadError("payload checksum mismatch")


def slices(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """``spans`` cut into slices (index ranges): all of them when their data are at
    most WHOLE_BYTES, else consecutive tensors of at most SLICE_BYTES, a larger
    tensor alone."""
    if not spans or spans[-1][4] - spans[0][3] <= WHOLE_BYTES:
        return [(0, len(spans))] if spans else []
    out: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(spans) + 1):
        if i == len(spans) or spans[i][4] - spans[lo][3] > SLICE_BYTES:
            out.append((lo, i))
            lo = i
    return out
