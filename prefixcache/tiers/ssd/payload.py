"""Payload files of the SSD tier: a safetensors file per block or run (runfiles.py).

A block's arrays are written as a standard safetensors file (readable by ``mx.load``
and the ``safetensors`` package) named by its key's hex and fanned out into 256
subdirectories. Writes are atomic: a temp file named with pid and thread id in the
same directory, fsync, rename, fsync of the directory. The xxh3-64 of the whole
file's bytes is computed while writing and verified on every read of the whole
file. Each tensor's header entry also holds its own xxh3-64 and that of the data
from the first tensor to its end (``digests.py``, computed in a pass before the
write: the header comes first), so a restore can leave tensors it does not use unread.

A header is checked before anything is sized from it: its length against the file
and MAX_HEADER, every tensor's dtype, shape and offsets against the data bytes that
follow (so no claimed shape can make a reader allocate more than the file holds).

Reading picks the faster of two readers by file size (``SMALL_PAYLOAD``): small
files are read whole, verified, and copied into MLX once (the arrays are views of
that copy); large ones go through ``mx.load``, which reads each array straight into
fresh MLX memory with a thread pool, and are verified by hashing the arrays in file
order (safetensors has no holes, so that covers every byte of the file).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import struct
import threading
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import xxhash

from ...errors import PayloadError
from ...memory.host import ITEMSIZE, MX_DTYPES, Tensor
from ...memory.restore_buffers import ALIGN
from . import digests as tensor_digests
from .files import create_temp, open_sized, parent_fd, temp_path

PAYLOAD_FORMAT = "prefixcache-block/1"
# Headers take ~100 bytes a tensor: far below MAX_HEADER; a longer one is refused unread
MAX_HEADER, DATA_ALIGN = 1 << 20, ALIGN  # DATA_ALIGN: where the data starts, as a buffer
_MAX_DIM = (1 << 31) - 1  # MLX shapes are int32

_Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
# encode_header's first member up to the key's hex. Blocks of one layout differ in
# their header only there: the rest is parsed once (parse_header).
_HEAD = b'{"__metadata__":{"format":"' + PAYLOAD_FORMAT.encode() + b'","key":"'
KEY_AT = len(_HEAD)  # where the key's hex starts in such a header
_STAND_IN = "g" * 32  # never a key's hex
# Up to this file size one read + one copy beats mx.load's per-array reads
# (tools/bench_ssd.py: ~1.3x at 0.5 MiB; mx.load wins from ~5 MiB on).
SMALL_PAYLOAD = 2 << 20
_HASH_CHUNK = 1 << 20  # hash in slices: a stall is bounded where xxhash holds the GIL


def encode_header(
    tensors: list[Tensor],
    key: bytes,
    digests: Sequence[tuple[int, int | None]] | None = None,
    run: str | None = None,
) -> bytes:
    """The safetensors prefix: u64 length + JSON header padded to ``DATA_ALIGN``, each
    tensor's entry with its digest and lead digest (``digests.py``).

    Args:
        digests: the tensors' (digest, lead digest or None: none written) in
            order; None: computed here (a pass over the data); ``()``: none
            written (files as written before digests).
        run: a run file's ``run`` metadata (``runfiles.metadata``), or None.

    Raises:
        ValueError: the header would be longer than MAX_HEADER (readers refuse it).
    """
    if digests is None:
        digests = tensor_digests.of_tensors(tensors)
    meta = {"format": PAYLOAD_FORMAT, "key": key.hex(), **({"run": run} if run else {})}
    entries: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for i, t in enumerate(tensors):
        end = offset + t.data.nbytes
        entry = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        if digests:
            digest, lead = digests[i]
            entry[tensor_digests.FIELD] = f"{digest:016x}"
            if lead is not None:
                entry[tensor_digests.LEAD] = f"{lead:016x}"
        entries[t.name] = entry
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    if len(text) > MAX_HEADER:
        raise ValueError(f"payload header of {len(text)} bytes is over {MAX_HEADER}")
    return struct.pack("<Q", len(text)) + text


def write_payload(final: str, header: bytes, tensors: list[Tensor]) -> tuple[int, int]:
    """Atomically write a payload file; returns (file bytes, xxh3-64 checksum).

    Everything happens through the fan-out directory's descriptor (created
    0700, never a symlink); the temp file is removed if anything fails and the
    exception propagates.
    """
    head, name = os.path.split(final)
    tmp = os.path.basename(temp_path(final, os.getpid(), threading.get_native_id()))
    hasher = xxhash.xxh3_64(header)
    with parent_fd(head, create=True) as dfd:
        fd = create_temp(tmp, dfd)
        try:
            try:
                _write_all(fd, memoryview(header))
                for t in tensors:
                    for start in range(0, t.data.nbytes, _HASH_CHUNK):
                        hasher.update(t.data[start : start + _HASH_CHUNK])
                    _write_all(fd, t.data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    return len(header) + sum(t.data.nbytes for t in tensors), hasher.intdigest()


def read_payload(
    path: str, key: bytes, file_bytes: int, checksum: int, *, reader: str = "auto"
) -> tuple[dict[str, mx.array], int]:
    """Read and verify a payload file; returns (fresh arrays, their nbytes).

    Args:
        reader: ``"buffer"`` (one read, verify, one copy into MLX, arrays are
            views of that copy), ``"mx_load"`` (``mx.load`` reads each array
            with its thread pool; verified after), or ``"auto"``: buffer up to
            SMALL_PAYLOAD bytes, where per-array reads cost more than the copy.

    Raises:
        FileNotFoundError: the file does not exist.
        PayloadError: wrong size, bad header, wrong key, checksum mismatch, or
            the path is a symlink (never followed).
    """
    fd, size = open_sized(path)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if size != file_bytes:
            raise PayloadError(f"payload has {size} bytes, index says {file_bytes}")
        prefix, spans = read_spans(f.fileno(), key, size)
        hasher = xxhash.xxh3_64(prefix)
        if reader == "auto":
            reader = "buffer" if size <= SMALL_PAYLOAD else "mx_load"
        if reader == "buffer":
            arrays = _read_buffered(f.fileno(), len(prefix), size, spans, hasher)
        else:
            arrays = _read_mx_load(f.fileno(), path, spans, hasher)
    if hasher.intdigest() != checksum:
        raise PayloadError("payload checksum mismatch")
    return arrays, sum(a.nbytes for a in arrays.values())


def read_spans(fd: int, key: bytes, size: int) -> tuple[bytes, tuple[_Span, ...]]:
    """(the file's header bytes, its checked tensors in file order) from ``fd``.

    The header length is checked before the header is read, and the tensors
    before any buffer is sized from them.

    Raises:
        PayloadError: the header is bad, too long, or does not fit the file.
    """
    head = os.pread(fd, 8, 0)
    length = header_length(head, size)
    text = os.pread(fd, length, 8)
    if len(text) != length:
        raise PayloadError("short read")
    return head + text, parse_header(text, key, size - 8 - length)


def _read_buffered(
    fd: int, base: int, size: int, spans: Sequence[_Span], hasher: xxhash.xxh3_64
) -> dict[str, mx.array]:
    buf = np.empty(size - base, dtype=np.uint8)
    if buf.size and os.preadv(fd, [buf], base) != buf.size:
        raise PayloadError("short read")
    hasher.update(buf)
    flat = mx.array(buf)  # the one copy
    arrays = {
        name: flat[start:end].view(MX_DTYPES[dtype]).reshape(shape)
        for name, dtype, shape, start, end in spans
    }
    mx.eval(arrays)
    return arrays


def _read_mx_load(
    fd: int, path: str, spans: Sequence[_Span], hasher: xxhash.xxh3_64
) -> dict[str, mx.array]:
    # mx.load opens by path: give it this very file (already checked not to be a symlink)
    source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path
    try:
        loaded = mx.load(source, format="safetensors")
        arrays = {name: loaded[name] for name, *_ in spans}  # in file order
        mx.eval(arrays)
    except (RuntimeError, ValueError, KeyError) as e:
        raise PayloadError(f"mx.load failed: {e}") from None
    for arr in arrays.values():
        if arr.size:
            hasher.update(memoryview(arr).cast("B"))
    return arrays


def read_header(path: str, key: bytes) -> list[tuple[str, mx.Dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of a payload's tensors from its header alone:
    consistent with the file's size, but the data are neither read nor verified.

    Raises:
        OSError: the file cannot be read.
        PayloadError: the header is bad, or the path is a symlink.
    """
    fd, size = open_sized(path)
    try:
        _, spans = read_spans(fd, key, size)
    finally:
        os.close(fd)
    return [(name, MX_DTYPES[dtype], shape) for name, dtype, shape, _, _ in spans]


def header_length(head: bytes, size: int) -> int:
    """The header length an 8-byte prefix claims, if it fits the file and MAX_HEADER."""
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise PayloadError(f"bad safetensors header length {length}")
    return length


def parse_header(text: bytes, key: bytes, data_bytes: int) -> tuple[_Span, ...]:
    """Validate a header; returns its tensors in file order.

    A header that starts as encode_header writes it, with ``key``, is judged by
    the rest: that header with any other key in its place parses alike, so the
    rest's verdict is kept (unless the rest could name the metadata again).
    """
    return parse_layout(text, key, data_bytes)[0]


def parse_layout(
    text: bytes, key: bytes, data_bytes: int
) -> tuple[tuple[_Span, ...], tensor_digests.Layout | None]:
    """As ``parse_header``, with the header's layout for ``digests.py`` (where its
    entries start, them with their digests zeroed; None where the header is not as
    encode_header writes it)."""
    head = _HEAD + key.hex().encode()
    rest = text[len(head) :]
    if text.startswith(head) and b"__metadata__" not in rest and b"\\" not in rest:
        entries = tensor_digests.masked(rest)
        return _rest_spans(entries, data_bytes), (len(head), entries)
    return _parse(text, key.hex(), data_bytes), None


@functools.lru_cache(maxsize=64)
def _rest_spans(rest: bytes, data_bytes: int) -> tuple[_Span, ...]:
    return _parse(_HEAD + _STAND_IN.encode() + rest, _STAND_IN, data_bytes)


def _parse(text: bytes, key_hex: str, data_bytes: int) -> tuple[_Span, ...]:
    try:
        entries = json.loads(text)
        meta = entries.pop("__metadata__", {})
        raw = sorted((tuple(v["data_offsets"]), name, v) for name, v in entries.items())
        spans = [(name, v["dtype"], tuple(v["shape"]), s, e) for (s, e), name, v in raw]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise PayloadError(f"bad safetensors header: {type(e).__name__}: {e}") from None
    run = meta.pop("run", "") if isinstance(meta, dict) else ""  # a run file's (runfiles.py)
    if meta != {"format": PAYLOAD_FORMAT, "key": key_hex} or not isinstance(run, str):
        raise PayloadError(f"payload metadata {meta!r} does not match key {key_hex}")
    offset = 0
    for name, dtype, shape, start, end in spans:
        if not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
            raise PayloadError(f"tensor {name!r} has shape {shape}")
        count = 1
        for dim in shape:
            count *= dim
        size = count * ITEMSIZE[dtype] if isinstance(dtype, str) and dtype in ITEMSIZE else -1
        if not (_is_int(start) and _is_int(end)) or start != offset or end - start != size:
            raise PayloadError(f"tensor {name!r} has bad offsets or dtype")
        offset = end
    if offset != data_bytes:
        raise PayloadError(f"tensors cover {offset} of {data_bytes} data bytes")
    return tuple(spans)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
