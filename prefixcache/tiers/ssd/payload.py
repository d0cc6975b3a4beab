"""Payload files of the SSD tier: one safetensors file per block, checksummed.

A block's arrays are written as a standard safetensors file (readable by
``mx.load`` and the ``safetensors`` package) named by the block key's hex and
fanned out into 256 subdirectories. Writes are atomic: a temp file named with
pid and thread id in the same directory, fsync, rename, fsync of the directory.
The xxh3-64 of the whole file's bytes is computed while writing and verified on
every read.

Reading picks the faster of two readers by file size (tools/bench_ssd.py
measures both): small files are read whole, verified, and copied into MLX once
(the arrays are views of that copy); large ones go through ``mx.load``, which
reads each array straight into fresh MLX memory with a thread pool, and are
verified by hashing the arrays in file order (safetensors has no holes, so
that covers every byte of the file).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from typing import BinaryIO

import mlx.core as mx
import numpy as np
import xxhash

from ...errors import PayloadError

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
PAYLOAD_FORMAT = "prefixcache-block/1"
_MAX_HEADER = 100 << 20  # safetensors' own limit

_DTYPES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
}  # fmt: skip
_ITEMSIZE = {name: dtype.size for dtype, name in _DTYPES.items()}
_MX_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_Span = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, start, end
# Up to this file size one read + one copy beats mx.load's per-array reads
# (tools/bench_ssd.py: ~1.3x at 0.5 MiB; mx.load wins from ~5 MiB on).
SMALL_PAYLOAD = 2 << 20
_HASH_CHUNK = 1 << 20  # xxhash holds the GIL: hash in slices so callers are not stalled


@dataclass(frozen=True, slots=True)
class Tensor:
    """Raw bytes of one array, taken zero-copy on the caller's thread."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    data: memoryview  # flat bytes ('B' format)


def tensors_of(arrays: dict[str, mx.array]) -> list[Tensor]:
    """Zero-copy byte views of evaluated, row-contiguous arrays.

    Call on the thread that owns the arrays: ``memoryview`` reads MLX's buffer
    but runs no MLX computation, so the views are safe to hand to the writer.

    Raises:
        ValueError: an array has a dtype safetensors cannot hold or is not contiguous.
    """
    out = []
    for name, arr in arrays.items():
        if arr.dtype not in _DTYPES:
            raise ValueError(f"cannot store array {name!r} of dtype {arr.dtype}")
        view = memoryview(arr)
        if not view.c_contiguous:
            raise ValueError(f"array {name!r} is not row-contiguous")
        data = view.cast("B") if arr.size else memoryview(b"")
        out.append(Tensor(name, _DTYPES[arr.dtype], tuple(arr.shape), data))
    return out


def encode_header(tensors: list[Tensor], key: bytes) -> bytes:
    """The safetensors prefix: u64 length + JSON header padded to 8 bytes."""
    entries: dict[str, object] = {"__metadata__": {"format": PAYLOAD_FORMAT, "key": key.hex()}}
    offset = 0
    for t in tensors:
        end = offset + t.data.nbytes
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def payload_path(root: str, key: bytes) -> str:
    """``root/ab/abcdef....safetensors``: content-addressed, 256-way fan-out."""
    name = key.hex()
    return os.path.join(root, name[:2], name + SUFFIX)


def temp_path(final: str, pid: int, tid: int) -> str:
    """Temp name beside ``final``: unique per process and thread."""
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail[: -len(SUFFIX)]}.{pid}.{tid}{TEMP_SUFFIX}")


def write_payload(final: str, header: bytes, tensors: list[Tensor]) -> tuple[int, int]:
    """Atomically write a payload file; returns (file bytes, xxh3-64 checksum).

    The temp file is removed if anything fails; the exception propagates.
    """
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = temp_path(final, os.getpid(), threading.get_native_id())
    hasher = xxhash.xxh3_64(header)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _write_all(fd, memoryview(header))
            for t in tensors:
                for start in range(0, t.data.nbytes, _HASH_CHUNK):
                    hasher.update(t.data[start : start + _HASH_CHUNK])  # holds the GIL
                _write_all(fd, t.data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(final))
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
        PayloadError: wrong size, bad header, wrong key or checksum mismatch.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != file_bytes:
            raise PayloadError(f"payload has {size} bytes, index says {file_bytes}")
        if reader == "auto":
            reader = "buffer" if size <= SMALL_PAYLOAD else "mx_load"
        if reader == "buffer":
            arrays = _read_buffered(f, key, size, checksum)
        else:
            arrays = _read_mx_load(f, path, key, size, checksum)
    return arrays, sum(a.nbytes for a in arrays.values())


def _read_buffered(f: BinaryIO, key: bytes, size: int, checksum: int) -> dict[str, mx.array]:
    buf = np.empty(size, dtype=np.uint8)
    if f.readinto(buf) != size:
        raise PayloadError("short read")
    if xxhash.xxh3_64_intdigest(buf) != checksum:
        raise PayloadError("payload checksum mismatch")
    length = _header_length(bytes(buf[:8]), size)
    spans = _parse_header(bytes(buf[8 : 8 + length]), key, size - 8 - length)
    flat = mx.array(buf[8 + length :])  # the one copy
    arrays = {
        name: flat[start:end].view(_MX_DTYPES[dtype]).reshape(shape)
        for name, dtype, shape, start, end in spans
    }
    mx.eval(arrays)
    return arrays


def _read_mx_load(
    f: BinaryIO, path: str, key: bytes, size: int, checksum: int
) -> dict[str, mx.array]:
    head = f.read(8)
    length = _header_length(head, size)
    text = f.read(length)
    spans = _parse_header(text, key, size - 8 - length)
    hasher = xxhash.xxh3_64(head)
    hasher.update(text)
    try:
        loaded = mx.load(path)
        arrays = {name: loaded[name] for name, *_ in spans}  # in file order
        mx.eval(arrays)
    except (RuntimeError, ValueError, KeyError) as e:
        raise PayloadError(f"mx.load failed: {e}") from None
    for arr in arrays.values():
        if arr.size:
            hasher.update(memoryview(arr).cast("B"))
    if hasher.intdigest() != checksum:
        raise PayloadError("payload checksum mismatch")
    return arrays


def read_header(path: str, key: bytes) -> list[tuple[str, mx.Dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of a payload's tensors from its header alone:
    consistent with the file's size, but the data are neither read nor verified.

    Raises:
        OSError: the file cannot be read.
        PayloadError: the header is bad.
    """
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        length = _header_length(os.pread(fd, 8, 0), size)
        text = os.pread(fd, length, 8)
    spans = _parse_header(text, key, size - 8 - length)
    return [(name, _MX_DTYPES[dtype], shape) for name, dtype, shape, _, _ in spans]


def _header_length(head: bytes, size: int) -> int:
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise PayloadError(f"bad safetensors header length {length}")
    return length


def _parse_header(text: bytes, key: bytes, data_bytes: int) -> list[_Span]:
    """Validate a header; returns its tensors in file order."""
    try:
        entries = json.loads(text)
        meta = entries.pop("__metadata__", {})
        raw = sorted((tuple(v["data_offsets"]), name, v) for name, v in entries.items())
        spans = [(name, v["dtype"], tuple(v["shape"]), s, e) for (s, e), name, v in raw]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise PayloadError(f"bad safetensors header: {e}") from None
    if meta != {"format": PAYLOAD_FORMAT, "key": key.hex()}:
        raise PayloadError(f"payload metadata {meta!r} does not match key {key.hex()}")
    offset = 0
    for name, dtype, shape, start, end in spans:
        count = 1
        for dim in shape:
            count *= dim
        if min(shape, default=0) < 0:
            raise PayloadError(f"tensor {name!r} has shape {shape}")
        if start != offset or end - start != count * _ITEMSIZE.get(dtype, -1):
            raise PayloadError(f"tensor {name!r} has bad offsets or dtype")
        offset = end
    if offset != data_bytes:
        raise PayloadError(f"tensors cover {offset} of {data_bytes} data bytes")
    return spans


def list_files(root: str) -> tuple[dict[bytes, str], list[str]]:
    """All payload files under ``root`` by key, and all temp files (for reconcile)."""
    payloads: dict[bytes, str] = {}
    temps: list[str] = []
    for sub in _scandir(root):
        if not (sub.is_dir() and len(sub.name) == 2):
            continue
        for entry in _scandir(sub.path):
            if entry.name.endswith(TEMP_SUFFIX):
                temps.append(entry.path)
            elif entry.name.endswith(SUFFIX):
                try:
                    payloads[bytes.fromhex(entry.name[: -len(SUFFIX)])] = entry.path
                except ValueError:
                    temps.append(entry.path)  # not ours to keep: a stray name
    return payloads, temps


def temp_owner(path: str) -> int:
    """The pid in a temp file name (0 if it has none)."""
    parts = os.path.basename(path).split(".")
    return int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else 0


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def unlink(path: str) -> None:
    """Remove a file; a file that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
