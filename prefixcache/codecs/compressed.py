"""Codec for deepseek_v41's LayerCache: a sliding window, compressed groups, open rows.

One layer's cache holds (each (B, T, dim), tokens on axis 1):

- ``window``: the K/V rows of its last ``window_size`` tokens;
- ``compress_kv`` (and ``index_k`` on an index layer): one row per closed group of
  ``r`` tokens (the layer's compress ratio; ``r`` = 1 compresses every token);
- ``pending_kv`` / ``pending_gate``: the projections of the tokens of the group
  still open, ``[floor(offset / r) * r, offset)``.

The class has no ``from_state``, so a restore sets these attributes. What can be
cut back: compressed rows never leave the cache, so every block carries the rows
of the groups that close inside it (``c.kv``, ``c.index``) whenever it is cut.
Window and open rows are held only near the cache's end, so a block carries them
(under ``w.``, the window policy's prefix) while they are there: whole
(``w.keys``), or from a first token on (``w.last.*``, ``w.pend.*``, as the
rotating and chunked codecs do). A restore at ``L`` needs the window rows of
``[L - window_size, L)`` and the open rows of ``[floor(L / r) * r, L)``:
checkpoints keep them where prompts resume; the builder refuses a block that
lost them. ``r`` is read from the cache (rows closed against tokens seen) and
kept with each block (``c.ratio``), as is the layer's kind (``c.kind``): no
compression, every token, or groups.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import LayerCache

from ..errors import LayoutMismatchError, MissReason
from .base import Builder, Codec, Payload, num_blocks, owned
from .kv import dtype_name

WINDOW = MissReason.WINDOW_NOT_COVERED
WINDOW_ROWS = ("w.keys", "w.last.keys", "w.last.first")
PLAIN, EVERY, GROUPS = 0, 1, 2  # c.kind: no compression here, every token, groups of r


def rows(x: mx.array | None) -> int:
    return 0 if x is None else x.shape[1]


def ratio_kind(cache: LayerCache) -> tuple[int, int]:
    """(compress ratio r, 0 while no group has closed; the layer's kind)."""
    closed, open_rows = rows(cache.compress_kv), rows(cache.pending_kv)
    ratio = (cache.offset - open_rows) // closed if closed else 0
    if cache.pending_kv is not None or ratio > 1:
        return ratio, GROUPS
    return ratio, EVERY if closed else PLAIN


def _from(x: mx.array, first: int, a: int, b: int) -> mx.array:
    """Rows of tokens ``[a, b)`` of ``x``, whose row 0 is token ``first``: a copy."""
    return owned(x[:, a - first : b - first])


class CompressedCodec(Codec):
    cache_type = LayerCache

    def layout(self, cache: LayerCache) -> tuple[object, ...]:
        if cache.window is None:
            raise LayoutMismatchError("LayerCache is empty: its layout is unknown")
        batch, _, dim = cache.window.shape
        if batch != 1:
            raise LayoutMismatchError(f"LayerCache has batch size {batch}; store one sequence")
        return ("LayerCache", cache.window_size, dtype_name(cache.window.dtype), dim)

    def length(self, cache: LayerCache) -> int:
        return cache.offset

    def trimmable_at(self, fresh: LayerCache, num_tokens: int) -> bool:
        return True  # rebuilt at any length from its blocks; the builder checks the rows

    def window(self, cache: LayerCache) -> tuple[str, int, int]:
        return ("w.", cache.window_size, 0)

    def reach(self, cache: LayerCache, length: int) -> int:
        if cache.window is None:
            return length
        return cache.offset - max(rows(cache.window), rows(cache.pending_kv))

    def cut(
        self, cache: LayerCache, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        if cache.window is None or end > cache.offset:
            return {}
        offset = cache.offset
        ratio, kind = ratio_kind(cache)
        out = {"c.kind": mx.array([kind, ratio], dtype=mx.int32)}
        held = offset - rows(cache.window)  # the window's first token
        a = max(start, held)
        if a == start:
            out["w.keys"] = _from(cache.window, held, a, end)
        elif a < end:  # the window moved past the block's first tokens
            out["w.last.keys"] = _from(cache.window, held, a, end)
            out["w.last.first"] = mx.array([a - start], dtype=mx.int32)
        if cache.pending_kv is not None:
            opened = offset - rows(cache.pending_kv)
            a = max(start, opened)
            if a < end:
                out["w.pend.kv"] = _from(cache.pending_kv, opened, a, end)
                out["w.pend.gate"] = _from(cache.pending_gate, opened, a, end)
                out["w.pend.first"] = mx.array([a - start], dtype=mx.int32)
        if ratio:
            lo, hi = start // ratio, end // ratio  # the groups closing inside the block
            if lo < hi:
                out["c.kv"] = owned(cache.compress_kv[:, lo:hi])
                if cache.index_k is not None:
                    out["c.index"] = owned(cache.index_k[:, lo:hi])
        return out

    def missing(
        self, fresh: LayerCache, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        first = max(0, num_tokens - fresh.window_size) // block_size
        for index in reversed(range(num_blocks(num_tokens, block_size))):
            has = payload(index)
            if has is None:
                continue
            if not has("c.kind"):
                return index, MissReason.LAYOUT_MISMATCH
            if index >= first and not (has("w.keys") or has("w.last.keys")):
                return index, WINDOW
        return None

    def builder(
        self, fresh: LayerCache, num_tokens: int, capacity: int, block_size: int
    ) -> Builder:
        return CompressedBuilder(fresh, num_tokens, block_size)


class CompressedBuilder(Builder):
    """Collects each block's rows, checks them as they come, sets the attributes at
    the end (new arrays: concatenations and copies of the payloads)."""

    def __init__(self, fresh: LayerCache, num_tokens: int, block_size: int):
        self.cache = fresh
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.last = num_blocks(num_tokens, block_size) - 1
        self.window_from = max(0, num_tokens - fresh.window_size)
        self.blocks: dict[int, dict[str, mx.array]] = {}
        self.state: dict[str, Any] = {}

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        if "c.kind" not in arrays:
            raise LayoutMismatchError(f"block {index} has no rows of this layer")
        self.blocks[index] = arrays
        if index == self.last:
            self.state = self._assemble()

    def _span(self, names: tuple[str, str, str], lo: int) -> mx.array:
        """Rows of tokens ``[lo, num_tokens)`` from the blocks holding them: ``names`` are
        the payload of a whole block's rows, of its rows from a first token on, and of
        that first token (a block may hold both: upgraded by a later cut)."""
        whole, part, first_name = names
        parts = []
        for index, arrays in sorted(self.blocks.items()):
            start = index * self.block_size
            end = min(start + self.block_size, self.num_tokens)
            a = max(lo, start)
            if a >= end:
                continue
            if whole in arrays:
                key, first = whole, start
            elif part in arrays:
                key, first = part, start + int(arrays[first_name].item())
            else:
                raise LayoutMismatchError(f"block {index} lost the rows of {part}", WINDOW)
            if first > a:
                raise LayoutMismatchError(f"block {index} lost the rows of {part}", WINDOW)
            parts.append(arrays[key][:, a - first : end - first])
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else mx.array(parts[0])

    def _assemble(self) -> dict[str, Any]:
        kind, ratio = (int(v) for v in self.blocks[self.last]["c.kind"].tolist())
        closed = self.num_tokens // ratio if ratio else 0
        out: dict[str, Any] = {"window": self._span(WINDOW_ROWS, self.window_from)}
        out["compress_kv"] = self._groups("c.kv", ratio, closed)
        out["index_k"] = self._groups("c.index", ratio, closed)
        opened = closed * ratio
        if kind == GROUPS and opened < self.num_tokens:
            out["pending_kv"] = self._span(("", "w.pend.kv", "w.pend.first"), opened)
            out["pending_gate"] = self._span(("", "w.pend.gate", "w.pend.first"), opened)
        return out

    def _groups(self, name: str, ratio: int, closed: int) -> mx.array | None:
        """The first ``closed`` compressed rows ``name`` (None: no group closed, or the
        layer keeps no such rows)."""
        if not closed or not any(name in arrays for arrays in self.blocks.values()):
            return None
        parts = []
        for index, arrays in sorted(self.blocks.items()):
            start = index * self.block_size
            lo, hi = start // ratio, min((start + self.block_size) // ratio, closed)
            if lo >= hi:
                continue
            if name not in arrays:
                raise LayoutMismatchError(f"block {index} has no rows of {name}")
            parts.append(arrays[name][:, : hi - lo])
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else mx.array(parts[0])

    def buffers(self) -> list[mx.array]:
        return [x for x in self.state.values() if x is not None]

    def finish(self) -> LayerCache:
        cache = self.cache
        for name, value in self.state.items():
            setattr(cache, name, value)
        cache.offset = self.num_tokens
        return cache
