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

Each entry also holds a lead digest (``"lead"``): the xxh3-64 of the data from
the file's first tensor to the end of this one, bound to those tensors' entries.
The writer puts what restores mostly skip (window K/V, recurrent state) last,
so the tensors a restore uses usually lead the file: one read and one hash call
(``lead_matches``) take them, however many there are.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Sequence

import xxhash

from ...errors import PayloadError
from ...memory.host import Tensor
from .read_into import Buffer, preadv_all

_Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
FIELD = "xxh3"
# Skip unused tensors only where each stretch of them is at least this long (or ends
# the file: the writer puts what restores mostly skip last): warm,
# reading a file whole in one call beats many short reads around short gaps
# (gpt-oss-20b's shape, with this at 0: its 32 KiB and 128 KiB gaps made the fetch
# 1.1-2.2x slower at blocks 16 and 64; its 512 KiB gaps at block 256 no slower:
# tools/bench_blocks.py --shape gpt-oss-20b --blocks 16 64 256 --tiers ssd).
MIN_SKIP = 256 << 10
_IOV_MAX = 512  # iovecs per preadv (the kernel's limit is 1024)
_HASH_CHUNK = 1 << 20  # hash in slices: a stall is bounded where xxhash holds the GIL
LEAD = "lead"
_MASK = re.compile(rb'"xxh3":"[0-9a-f]{16}"')
_MASKED = b'"xxh3":"' + b"0" * 16 + b'"'
_MASK_LEAD = re.compile(rb'"lead":"[0-9a-f]{16}"')
_MASKED_LEAD = b'"lead":"' + b"0" * 16 + b'"'
Layout = tuple[int, bytes]  # where a header's entries start in it, those entries masked
# A tensor's entry as encode_header writes it: its name, digest and lead digest
# (files written before lead digests have none).
_ENTRY = re.compile(
    rb'"([^"\\]+)":\{"dtype":"[^"\\]*","shape":\[[0-9,]*\],'
    rb'"data_offsets":\[[0-9]+,[0-9]+\],"xxh3":"([0-9a-f]{16})"(?:,"lead":"([0-9a-f]{16})")?\}'
)


@functools.lru_cache(maxsize=4096)
def seed(span: _Span) -> int:
    """The seed of a tensor's digest: the xxh3-64 of its header entry."""
    name, dtype, shape, start, end = span
    return xxhash.xxh3_64_intdigest(f"{name}\0{dtype}\0{shape}\0{start}\0{end}".encode())


def tensor_hasher(span: _Span) -> xxhash.xxh3_64:
    """An xxh3-64 of the tensor's data to come, seeded by its header entry."""
    return xxhash.xxh3_64(seed=seed(span))


def of_tensors(tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
    """Each tensor's (digest, lead digest), laid out one after another as in a
    payload file."""
    out = []
    offset = 0
    lead = xxhash.xxh3_64()  # the data from the file's first tensor on
    seeds: list[int] = []
    for t in tensors:
        end = offset + t.data.nbytes
        span = (t.name, t.dtype, tuple(t.shape), offset, end)
        hasher = tensor_hasher(span)
        for start in range(0, t.data.nbytes, _HASH_CHUNK):
            hasher.update(t.data[start : start + _HASH_CHUNK])
            lead.update(t.data[start : start + _HASH_CHUNK])
        seeds.append(seed(span))
        out.append((hasher.intdigest(), _lead(lead.intdigest(), seeds)))
        offset = end
    return out


def _lead(data: int, seeds: Sequence[int]) -> int:
    """A lead digest: the data's xxh3-64 bound to the entries of its tensors (their seeds)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(seeds) + 1}Q", data, *seeds))


def lead_matches(
    data: Buffer, spans: Sequence[_Span], digest: int, seeds: bytes | None = None
) -> bool:
    """Whether ``data`` (the data of ``spans``, the file's first tensors) has the lead
    digest of the last of them: one hash call verifies them all. ``seeds``:
    ``packed_seeds(spans)``, where a caller checks many files of one layout."""
    return data_leads(xxhash.xxh3_64_intdigest(data), spans, digest, seeds)


def data_leads(
    data_digest: int, spans: Sequence[_Span], digest: int, seeds: bytes | None = None
) -> bool:
    """``lead_matches`` for data hashed already (``data_digest``: its xxh3-64, as a
    streaming hasher gives it while the data is read into place)."""
    seeds = packed_seeds(spans) if seeds is None else seeds
    return xxhash.xxh3_64_intdigest(struct.pack("<Q", data_digest) + seeds) == digest


def packed_seeds(spans: Sequence[_Span]) -> bytes:
    """The seeds of ``spans`` as a lead digest binds them (``_lead``)."""
    return struct.pack(f"<{len(spans)}Q", *(seed(s) for s in spans))


def masked(text: bytes) -> bytes:
    """``text`` with every digest zeroed: headers of one layout alike again."""
    return _MASK_LEAD.sub(_MASKED_LEAD, _MASK.sub(_MASKED, text))


def worth_skipping(spans: Sequence[_Span], unused: Sequence[bool]) -> bool:
    """Whether the unused tensors (``unused[i]`` for ``spans[i]``) come in stretches
    of MIN_SKIP bytes or more, every one but a last one that ends the file (and
    there is one): a read that stops before the file's end costs no more reads."""
    stretch, any_unused = 0, False
    for span, skip in zip(spans, unused, strict=True):
        if skip:
            stretch += span[4] - span[3]
            any_unused = True
        elif stretch:
            if stretch < MIN_SKIP:
                return False
            stretch = 0
    return any_unused


def parse(
    text: bytes,
    spans: Sequence[_Span],
    wanted: Sequence[_Span] | None = None,
    layout: Layout | None = None,
) -> dict[str, int] | None:
    """name -> digest of each of ``wanted`` (None: every one of ``spans``) from a
    checked header's ``text`` (its ``layout`` if known), if every one of its
    tensors (``spans``) has exactly one; else None (the file is read whole)."""
    found = _found(text, spans, layout)
    if found is None:
        return None
    cut, where = found
    at = ((s[0], cut + where[s[0]][0]) for s in (spans if wanted is None else wanted))
    return {name: int(text[i : i + 16], 16) for name, i in at}


def lead(
    text: bytes, spans: Sequence[_Span], name: str, layout: Layout | None = None
) -> int | None:
    """The lead digest of tensor ``name`` (of the data from the first tensor to its
    end) in a checked header's ``text``; None where the file has none."""
    at = lead_at(text, spans, name, layout)
    return None if at is None else int(text[at : at + 16], 16)


def lead_at(
    text: bytes, spans: Sequence[_Span], name: str, layout: Layout | None = None
) -> int | None:
    """Where ``lead``'s 16 hex digits start in ``text``; None where it has none."""
    found = _found(text, spans, layout)
    if found is None:
        return None
    cut, where = found
    at = where[name][1]
    return None if at < 0 else cut + at


def _found(
    text: bytes, spans: Sequence[_Span], layout: Layout | None
) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """(where the entries start, name -> where its digest and lead digest start in
    them, -1: none), if every one of ``spans`` has exactly one digest; else None.

    Looked for after the header's first object (the metadata, which names the
    block's key; ``layout`` where the caller masked them already): the rest is
    alike for every block of a layout, so found once."""
    if layout is None:
        cut = text.find(b"}") + 1
        layout = (cut, masked(text[cut:]))
    cut, entries = layout
    where = _where(entries, len(spans))
    if where is None or any(s[0] not in where for s in spans):
        return None
    return cut, where


@functools.lru_cache(maxsize=64)
def _where(layout: bytes, count: int) -> dict[str, tuple[int, int]] | None:
    """name -> where its digest's and its lead digest's 16 hex digits start (-1:
    none), for headers of ``layout`` (digests zeroed: alike for a layout's
    blocks, so found once)."""
    found = list(_ENTRY.finditer(layout))
    where = {m.group(1).decode("utf-8", "replace"): (m.start(2), m.start(3)) for m in found}
    return where if len(found) == len(where) == count else None


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
