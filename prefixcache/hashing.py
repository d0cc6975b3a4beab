"""Versioned chain-hash spec: namespace root keys, per-block chain keys and tail keys.

Spec v1 (locked by golden vectors in tests/test_hashing.py; change it only with
a new version number):

- root key = xxh3_128(b"prefixcache/v1/root\\0" + canonical JSON of the namespace)
  where the namespace is ``{"format": 1, "model": model_id, "layout": [...],
  "kv_quant": [bits, group_size, start] | null, "extra": {...}}`` serialised
  with sorted keys, no spaces, ASCII only.
- block key = xxh3_128(parent key (16 bytes) + the block's token ids as
  little-endian uint32), digest in big-endian byte order (xxhash's ``digest``).
- tail key = xxh3_128(b"prefixcache/v1/tail\\0" + parent key (16 bytes) + the
  tail's token ids as little-endian uint32): the key of a stored sequence's
  last tokens (fewer than a block) after its last full block ``parent``. The
  tag keeps tail keys apart from block keys; tails are found through their
  parent (a tier's children lookup), never by hashing a prompt.

``common_tokens`` counts the leading tokens two token strings share: a match
inside a block, a tail or a live shared prefix, where keys only tell equal
blocks apart.
"""

from __future__ import annotations

import array
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

FORMAT_VERSION = 1
TOKEN_BYTES = 4  # a token id is stored as one little-endian uint32
_ROOT_TAG = b"prefixcache/v1/root\0"
_TAIL_TAG = b"prefixcache/v1/tail\0"
_NATIVE_LE = sys.byteorder == "little" and array.array("I").itemsize == 4
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a cached prefix depends on besides its tokens."""

    model_id: str
    layout: tuple[tuple[object, ...], ...]
    kv_quant: tuple[int, int, int] | None = None
    extra: tuple[tuple[str, str], ...] = field(default=())

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_VERSION,
            "model": self.model_id,
            "layout": [list(layer) for layer in self.layout],
            "kv_quant": list(self.kv_quant) if self.kv_quant else None,
            "extra": dict(self.extra),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def root_key(self) -> bytes:
        return xxhash.xxh3_128(_ROOT_TAG + self.to_json().encode("ascii")).digest()

    def with_extra(self, extra: Mapping[str, str] | None) -> Namespace:
        if not extra:
            return self
        merged = dict(self.extra)
        for name, value in extra.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError(f"extra keys must map str to str, got {name!r}: {value!r}")
            merged[name] = value
        return Namespace(self.model_id, self.layout, self.kv_quant, tuple(sorted(merged.items())))


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Validate token ids and encode them as little-endian uint32 bytes.

    A list of ints goes through ``array.array("I")`` (which checks the range
    as it packs: several times faster than numpy's conversion of a list).

    Raises:
        TypeError: tokens are not integers.
        ValueError: a token is negative or does not fit in uint32.
    """
    if _NATIVE_LE and isinstance(tokens, list | tuple | range):
        try:
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            pass  # numpy below names the bad value
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        bad = next((t for t in np.asarray(tokens, dtype=object) if not _is_int(t)), arr.dtype)
        raise TypeError(f"tokens must be integers, got {bad!r}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN:
        raise ValueError(f"token ids must be in [0, 2**32), got {lo if lo < 0 else hi}")
    return arr.astype("<u4", copy=False).tobytes()


def nonempty(tokens: Sequence[int]) -> bytes:
    """``tokens`` as uint32 bytes; a prompt needs at least one token."""
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def tail_key(parent: bytes, tail: bytes) -> bytes:
    """Key of a sequence's tail ``tail`` (uint32 token bytes, shorter than a block)
    stored after its last full block ``parent`` (a block key or the root key)."""
    return xxhash.xxh3_128(_TAIL_TAG + parent + tail).digest()


def chain_keys(root: bytes, data: bytes, block_size: int) -> list[bytes]:
    """Keys of every full block of ``data`` (uint32 token bytes), in order."""
    step = block_size * TOKEN_BYTES
    keys: list[bytes] = []
    parent = root
    digest = xxhash.xxh3_128_digest  # the function: no hasher object per block
    for start in range(0, len(data) - step + 1, step):
        parent = digest(parent + data[start : start + step])
        keys.append(parent)
    return keys


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens (uint32 bytes) ``a`` and ``b`` share (bisection of slice compares)."""
    hi = min(len(a), len(b)) // TOKEN_BYTES
    if a[: hi * TOKEN_BYTES] == b[: hi * TOKEN_BYTES]:
        return hi
    lo = 0  # a[:lo] == b[:lo] and a[:hi] != b[:hi], in tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo
