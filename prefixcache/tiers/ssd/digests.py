"""Per-tensor digests of a payload file: tensors a restore does not use stay unread.

The file's whole xxh3-64 (its index entry's checksum) covers every byte, so a
reader that checks only it reads every byte. The writer also records each
tensor's xxh3-64 in the tensor's own header entry (``"xxh3"``: 16 hex digits;
the safetensors readers, ``mx.load`` and readers of files without it ignore
the field). A restore that uses only some of a file's tensors (a window
layer's K/V behind its window: ``UNNEEDED``) reads the header and the tensors
it uses, each verified against its digest; a file without digests is read and
verified whole. A digest also covers its tensor's header entry (name, dtype,
shape, offsets): a damaged entry of a used tensor fails like damaged data.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import xxhash

from ...errors import PayloadError
from ...memory.host import Tensor
from .read_into import Buffer, preadv_all

_Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
FIELD = "xxh3"
_IOV_MAX = 512  # iovecs per preadv (the kernel's limit is 1024)
_HASH_CHUNK = 1 << 20  # hash in slices: a stall is bounded where xxhash holds the GIL
_MASK = re.compile(rb'"xxh3":"[0-9a-f]{16}"')
_MASKED = b'"xxh3":"' + b"0" * 16 + b'"'
# A tensor's entry as encode_header writes it: its name and digest.
_ENTRY = re.compile(
    rb'"([^"\\]+)":\{"dtype":"[^"\\]*","shape":\[[0-9,]*\],'
    rb'"data_offsets":\[[0-9]+,[0-9]+\],"xxh3":"([0-9a-f]{16})"\}'
)


def tensor_hasher(span: _Span) -> xxhash.xxh3_64:
    """An xxh3-64 primed with the tensor's header entry; its data go in next."""
    name, dtype, shape, start, end = span
    entry = f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{start}\0{end}\0"
    return xxhash.xxh3_64(entry.encode())


def of_tensors(tensors: Sequence[Tensor]) -> list[int]:
    """Each tensor's digest, laid out one after another as in a payload file."""
    out = []
    offset = 0
    for t in tensors:
        end = offset + t.data.nbytes
        hasher = tensor_hasher((t.name, t.dtype, tuple(t.shape), offset, end))
        for start in range(0, t.data.nbytes, _HASH_CHUNK):
            hasher.update(t.data[start : start + _HASH_CHUNK])
        out.append(hasher.intdigest())
        offset = end
    return out


def masked(text: bytes) -> bytes:
    """``text`` with every digest zeroed: headers of one layout alike again."""
    return _MASK.sub(_MASKED, text)


def parse(text: bytes, spans: Sequence[_Span]) -> dict[str, int] | None:
    """name -> digest from a checked header's ``text``, if every one of its
    tensors (``spans``) has exactly one; else None (the file is read whole)."""
    found = _ENTRY.findall(text)
    if len(found) != len(spans):
        return None
    digests = {name.decode("utf-8", "replace"): int(hex_, 16) for name, hex_ in found}
    if len(digests) != len(spans) or any(s[0] not in digests for s in spans):
        return None
    return digests


def read_used(
    fd: int, pieces: list[tuple[_Span, list[Buffer]]], base: int, digests: dict[str, int]
) -> None:
    """Read each tensor (its span, the views it goes into, in order) from the data
    at ``base`` on, and verify it against its digest.

    Raises:
        PayloadError: a short read or a digest mismatch.
    """
    for span, views in pieces:
        hasher = tensor_hasher(span)
        start = base + span[3]
        for i in range(0, len(views), _IOV_MAX):
            batch = views[i : i + _IOV_MAX]
            size = sum(len(v) for v in batch)
            preadv_all(fd, batch, start, size)
            for view in batch:
                hasher.update(view)
            start += size
        if hasher.intdigest() != digests[span[0]]:
            raise PayloadError(f"payload tensor {span[0]!r} digest mismatch")
