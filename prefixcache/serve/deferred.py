"""Inserts mlx-lm makes before a request's first token, stored after it.

mlx-lm's server (batch path) inserts a request's cache at the end of its
system segment and of its prompt but the last token (cache types "system" and
"user"), both before the first token is sampled. Storing cuts and copies the
new blocks: about 1 ms a request on bench_serve's model, more for a long new
prompt, all of it time to first token. So the adapter only starts evaluating
such a cache (its arrays then stop holding the batch's buffers, which the
next decode step would otherwise copy) and stores it at its next call from the
generation thread: the request's final insert, a fetch or a checkpoint query
that could use it, or close (``MAX_DEFERRED`` and ``MAX_DEFERRED_BYTES`` bound
what waits). mlx-lm's own cache stores its entries unevaluated, and pays for
them later too. Keeping the cache is safe: mlx-lm extracts it from its batch for
the insert and does not use it again (a live cache, which a prefill goes on
writing, is inserted as "assistant": at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .fit import ModelKey
from .request_options import RequestOptions

DEFERRED_TYPES = frozenset({"system", "user"})
# At most this many inserts, and bytes of their caches, wait; beyond, an insert is
# stored at once. Each waiting cache is a copy of its request's whole K/V held until
# the request ends: a long prompt's (where storing costs little against its
# prefill) must not double its memory for the whole reply.
MAX_DEFERRED = 16
MAX_DEFERRED_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Deferred:
    """One insert to store: its model key, tokens, cache, type and request options."""

    model: ModelKey
    tokens: list[int]
    cache: list[Any]
    cache_type: str
    options: RequestOptions


class DeferredInserts:
    """The inserts waiting for their request's next call (not thread-safe: the
    adapter's lock)."""

    def __init__(self) -> None:
        self._items: list[tuple[Deferred, int]] = []  # (insert, its cache's bytes)
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Deferred) -> bool:
        """Keep ``item`` (its arrays' evaluation started); False, keeping nothing,
        past ``MAX_DEFERRED`` or ``MAX_DEFERRED_BYTES``: store it now."""
        leaves = tree_flatten([c.state for c in item.cache])  # KVCache's holds its offset
        arrays = [a for _, a in leaves if isinstance(a, mx.array)]
        nbytes = sum(a.nbytes for a in arrays)  # from the shapes: nothing is evaluated
        if len(self._items) >= MAX_DEFERRED or self.nbytes + nbytes > MAX_DEFERRED_BYTES:
            return False
        mx.async_eval(arrays)
        self._items.append((item, nbytes))
        self.nbytes += nbytes
        return True

    def take(self, tokens: Sequence[int] | None = None, block_size: int = 0) -> list[Deferred]:
        """Remove and return every insert (``tokens`` None), or those whose first
        block (their tokens, if fewer) ``tokens`` shares: a fetch of ``tokens``
        could restore from them."""
        out, keep = [], []
        for item, nbytes in self._items:
            n = min(block_size, len(item.tokens))
            shares = tokens is None or (n > 0 and list(tokens[:n]) == item.tokens[:n])
            (out if shares else keep).append((item, nbytes))
        self._items = keep
        self.nbytes = sum(nbytes for _, nbytes in keep)
        return [item for item, _ in out]
