"""Codec for RotatingKVCache: sliding-window attention kept in a ring buffer.

The ring holds only the first ``keep`` tokens and the last ``max_size - keep``
ones, so a block's K/V must be cut while its tokens are still there: after
every prefill chunk (a chunk of S tokens leaves the last W - 1 + S in place).
A restore needs the window only: the blocks covering the last
``max_size - keep`` tokens plus the first ``keep``. The rebuilt buffer is in
temporal order and holds at least ``max_size`` tokens once the prompt is that
long: mlx-lm's RotatingKVCache holding exactly W - 1 tokens fails on a 1-token
step (``ValueError``: negative dimensions), so a restore never leaves it there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from ..errors import LayoutMismatchError, MissReason
from ..memory.copies import Copies
from ..memory.host import HostArray
from .base import Builder, Codec, Payload, Resident, num_blocks, owned_tokens, run_shape
from .buffer import TokenBuffer
from .kv import kv_signature

WINDOW = MissReason.WINDOW_NOT_COVERED


@dataclass(frozen=True, slots=True)
class Ring:
    """Where a live RotatingKVCache keeps its tokens.

    Tokens ``[0, keep)`` sit at buffer positions ``[0, keep)``; the tail
    ``[first, offset)`` sits in the ring ``[keep, size)``, oldest at ``oldest``.
    """

    keep: int
    size: int
    first: int
    oldest: int

    @classmethod
    def of(cls, cache: RotatingKVCache) -> Ring:
        n, idx, offset = cache.keys.shape[2], cache._idx, cache.offset
        rotated = idx != n and idx < offset  # as RotatingKVCache._temporal_order reads it
        size = n if idx == n or rotated else idx  # else still growing: [0, idx) is used
        keep = min(cache.keep, size)
        return cls(keep, size, offset - (size - keep), idx if rotated else keep)

    def segments(self, start: int, end: int) -> list[tuple[int, int]]:
        """Buffer ranges holding tail tokens ``[start, end)`` (``start >= first``), in order."""
        ring = self.size - self.keep
        pos = self.keep + (self.oldest - self.keep + start - self.first) % ring
        head = min(end - start, self.size - pos)
        out = [(pos, pos + head)]
        if head < end - start:
            out.append((self.keep, self.keep + end - start - head))
        return out


def tail_start(fresh: RotatingKVCache, num_tokens: int, block_size: int) -> int:
    """First window token a cache rebuilt at ``num_tokens`` holds after its ``keep`` ones:
    exactly the window (``max_size`` tokens in all), as a 1-token step leaves it."""
    window = fresh.max_size - fresh.keep
    if num_tokens <= fresh.max_size:
        return fresh.keep
    return max(fresh.keep, num_tokens - window)


def _tokens(x: Any, lo: int, hi: int) -> Any:
    """Tokens ``[lo, hi)`` of a block tensor: an MLX array, a streamed HostArray (a
    copy: it is only valid until the next block) or a Placed one (the whole block,
    where ``destination`` put it; part of one is copied out of its place)."""
    if lo == 0 and hi == x.shape[2]:
        return x
    if isinstance(x, mx.array):
        return x[..., lo:hi, :]
    rows = x.rows() if isinstance(x, HostArray) else x.region
    part = np.ascontiguousarray(rows[:, :, lo:hi, :]).reshape(-1)
    return HostArray(part, x.dtype, (*x.shape[:2], hi - lo, x.shape[3]))


def _gather(x: mx.array, ranges: list[tuple[int, int]]) -> mx.array:
    parts = [x[..., a:b, :] for a, b in ranges]
    # new arrays either way: the payload must not pin the live ring
    if len(parts) > 1:
        return mx.concatenate(parts, axis=2)
    ((a, b),) = ranges
    return owned_tokens(x, a, b)


class RotatingKVCodec(Codec):
    cache_type = RotatingKVCache

    def layout(self, cache: RotatingKVCache) -> tuple[object, ...]:
        return (*kv_signature(cache), cache.max_size, cache.keep)

    def length(self, cache: RotatingKVCache) -> int:
        return cache.offset

    def trimmable_at(self, fresh: RotatingKVCache, num_tokens: int) -> bool:
        return True  # rebuilt at any length from the window's blocks, no trim needed

    def window(self, cache: RotatingKVCache) -> tuple[str, int, int]:
        return ("", cache.max_size - cache.keep, cache.keep)

    def reach(self, cache: RotatingKVCache, length: int) -> int:
        return length if cache.keys is None else Ring.of(cache).first

    def cut(
        self, cache: RotatingKVCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        if cache.keys is None or end > cache.offset:
            return {}
        ring = Ring.of(cache)
        head = [(start, min(end, ring.keep))] if start < ring.keep else []
        tail = max(start, ring.keep)
        if tail < end and tail < ring.first:  # partly overwritten
            return self._partly_overwritten(cache, ring, head, start, end)
        ranges = head + (ring.segments(tail, end) if tail < end else [])
        return {"keys": _gather(cache.keys, ranges), "values": _gather(cache.values, ranges)}

    @staticmethod
    def _partly_overwritten(
        cache: RotatingKVCache, ring: Ring, head: list, start: int, end: int
    ) -> dict[str, mx.array]:
        """A block whose first window tokens the ring overwrote: its ``keep`` tokens,
        and the tokens still held (``last.*``, from ``last.first`` in the block), which
        a restore ending near the window's end needs (a finished cache's last window)."""
        out = {}
        if head:
            out["keep.keys"] = _gather(cache.keys, head)
            out["keep.values"] = _gather(cache.values, head)
        if ring.first < end:
            tail = ring.segments(ring.first, end)
            out["last.keys"] = _gather(cache.keys, tail)
            out["last.values"] = _gather(cache.values, tail)
            out["last.first"] = mx.array([ring.first - start], dtype=mx.int32)
        return out

    def blocks_needed(
        self, fresh: RotatingKVCache, num_tokens: int, block_size: int
    ) -> Sequence[int]:
        last = num_blocks(num_tokens, block_size)
        first = tail_start(fresh, num_tokens, block_size) // block_size
        head = num_blocks(fresh.keep, block_size)
        if head >= first:
            return range(last)
        return (*range(head), *range(first, last))

    def missing(
        self, fresh: RotatingKVCache, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        tail = tail_start(fresh, num_tokens, block_size)
        for index in reversed(self.blocks_needed(fresh, num_tokens, block_size)):
            has = payload(index)
            if has is None or has("keys") or has("last.keys"):
                continue  # how far ``last`` reaches back, the builder checks
            if not ((index + 1) * block_size <= tail and has("keep.keys")):
                return index, WINDOW
        return None

    def builder(
        self, fresh: RotatingKVCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return RotatingBuilder(fresh, num_tokens, capacity, block_size)


class RotatingBuilder(Builder):
    """Lays out ``keep`` tokens then the window, in temporal order.

    Up to ``max_size`` tokens the cache is in its growing phase (``_idx ==
    offset``, room up to ``max_size``); past it the buffer holds exactly the
    tokens kept and ``_idx`` is its length, as mlx-lm leaves it after a chunk.
    Streamed blocks land in the buffers as a KVBuilder's do: a block (or a run
    of blocks) wholly among the ``keep`` tokens or wholly in the window is read
    straight into place (``destination``); the rest come as host bytes, copied in.
    """

    takes_host = True  # TokenBuffer takes streamed HostArrays and Placed tensors
    placed_checks_only = True  # a Placed tensor is a whole block ``destination`` placed

    def __init__(self, fresh: RotatingKVCache, num_tokens: int, capacity: int, block_size: int):
        self.cache = fresh
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.keep = fresh.keep
        self.tail = tail_start(fresh, num_tokens, block_size)
        if num_tokens <= fresh.max_size:
            size, self.idx = min(fresh.max_size, capacity), num_tokens
        else:
            size = self.keep + num_tokens - self.tail
            self.idx = size
        self.keys = TokenBuffer(size)
        self.values = TokenBuffer(size)

    def add(self, index: int, arrays: dict[str, Any]) -> None:
        start = index * self.block_size
        stop = min(start + self.block_size, self.num_tokens)  # this block's tokens restored
        whole = "keys" in arrays
        keep = "keys" if whole else "keep.keys"
        window, first = ("keys", start) if whole else ("last.keys", None)
        if not whole and window in arrays:
            last = arrays["last.first"]  # a scalar: a HostArray streamed
            first = start + int((last if isinstance(last, mx.array) else last.to_mx()).item())
        a, b = start, min(stop, self.keep)  # tokens kept at the front
        if a < b:
            if keep not in arrays:
                raise LayoutMismatchError(f"block {index} has no sliding-window keys", WINDOW)
            self._add(arrays, keep, start, a, b, a)
        a, b = max(start, self.tail), stop  # tokens of the window
        if a < b:
            if first is None or first > a:
                raise LayoutMismatchError(f"block {index} lost its window tokens", WINDOW)
            self._add(arrays, window, first, a, b, self.keep + a - self.tail)

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        """Hot blocks whose window payload is whole: their kept and window tokens as
        numpy views of their host bytes, one entry for those that follow each other.
        False, taking nothing, where a block holds part of its window (then one at a time)."""
        keys, values = prefix + "keys", prefix + "values"
        spans: list[list[Any]] = []  # [position, end, first payload, keys' and values' parts]
        try:
            for index, (arrays, views) in zip(indices, blocks, strict=True):
                start = index * self.block_size
                stop = min(start + self.block_size, self.num_tokens)
                window = max(start, self.tail)  # kept in front, then the window's tokens
                for a, b, pos in ((start, min(stop, self.keep), start), (window, stop, None)):
                    if a < b:
                        pos = self.keep + a - self.tail if pos is None else pos
                        if not spans or spans[-1][1] != pos:  # not where the last one ends
                            spans.append([pos, pos, arrays, [], []])
                        spans[-1][1] = pos + b - a
                        spans[-1][3].append(views[keys][:, :, a - start : b - start])
                        spans[-1][4].append(views[values][:, :, a - start : b - start])
        except KeyError:
            return False  # a block holding part of its window only
        for pos, end, arrays, ks, vs in spans:
            self.keys.add_views(pos, end, arrays[keys], ks)
            self.values.add_views(pos, end, arrays[values], vs)
        return True

    def _add(self, arrays: dict[str, Any], name: str, first: int, a: int, b: int, pos: int):
        """Tokens ``[a, b)`` of payload ``name`` (starting at token ``first``) at buffer ``pos``."""
        keys, values = arrays[name], arrays[name.replace("keys", "values")]
        self.keys.add(pos, _tokens(keys, a - first, b - first))
        self.values.add(pos, _tokens(values, a - first, b - first))

    def _position(self, start: int, stop: int) -> int | None:
        """Buffer position of tokens ``[start, stop)`` when all are kept in front or
        all in the window (and restored), else None."""
        if stop > self.num_tokens:
            return None  # a block cut back: only its first tokens are restored
        if stop <= self.keep:
            return start
        if start >= self.tail:
            return self.keep + start - self.tail
        return None

    def reserve(self, index: int, arrays: Mapping[str, Any]) -> list[mx.array]:
        """Buffers to allocate for a streamed block (see TokenBuffer.reserve)."""
        name = next((n for n in ("keys", "last.keys", "keep.keys") if n in arrays), None)
        if name is None:
            return []
        values = arrays.get(name.replace("keys", "values"))
        return self.keys.reserve(arrays[name]) + self.values.reserve(values)

    def destination(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        """Where the SSD stream may read block ``index``'s whole ``name`` tensor (of
        ``count`` blocks): only blocks wholly kept in front or wholly in the window."""
        buf = self.keys if name == "keys" else self.values if name == "values" else None
        run = run_shape(shape, count, self.block_size)
        if buf is None or run is None:
            return None
        start = index * self.block_size
        pos = self._position(start, start + run[2])
        return None if pos is None else buf.destination(pos, dtype, run)

    def allocate(self) -> list[mx.array]:
        return self.keys.allocate() + self.values.allocate()

    def queue_copies(self, copies: Copies) -> None:
        self.keys.queue_copies(copies)
        self.values.queue_copies(copies)

    def buffers(self) -> list[mx.array]:
        return [b for b in (self.keys.materialize(), self.values.materialize()) if b is not None]

    def finish(self) -> RotatingKVCache:
        self.cache.keys = self.keys.finish()
        self.cache.values = self.values.finish()
        self.cache.offset = self.num_tokens
        self.cache._idx = self.idx
        return self.cache
