"""The checkpoint protocol's verbs of a PrefixCache: stored_prefix, checkpoints,
capture, prefill, note_prefill.

State that cannot be cut back (recurrent layers, wrapped windows, chunks) is
kept where prompts will resume: ``checkpoints`` says where, ``capture`` keeps
it there, ``prefill`` does the whole loop. Mixed into
:class:`~prefixcache.cache.prefix_cache.PrefixCache`, whose lock each verb holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx

from ..hashing import TOKEN_BYTES, token_bytes
from ..tiers.stack import TierStack
from .lookup import Lookup


class CheckpointVerbs:
    """The checkpoint protocol of :class:`~prefixcache.cache.prefix_cache.PrefixCache` (mixed
    into it). It uses the cache's ``lookup``, ``tiers``, ``_lock``, ``_root``,
    ``_shared``, ``_store`` and ``_check_open``."""

    lookup: Lookup
    tiers: TierStack
    _lock: AbstractContextManager[object]

    def _root(self, extra: Mapping[str, str] | None) -> bytes: ...

    def _check_open(self) -> None: ...

    def _shared(self, data: bytes, root: bytes) -> int: ...

    def _store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        extra: Mapping[str, str] | None,
        *,
        session: str | None,
        persist: bool,
    ) -> int: ...

    def stored_prefix(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Tokens of ``tokens`` some stored sequence shares, restorable or not.

        Where this exceeds ``match`` on a model whose state cannot be cut back
        (recurrent layers, windows), the prompt leaves a stored sequence there
        without state to resume from: ``checkpoints`` names it.
        """
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            return self._shared(data, self._root(extra))

    def checkpoints(
        self,
        tokens: Sequence[int],
        num_cached: int = 0,
        *,
        extra: Mapping[str, str] | None = None,
    ) -> list[int]:
        """Where to ``capture`` the cache while prefilling ``tokens``: ascending
        positions in ``(num_cached, len(tokens))``.

        A model whose caches can be cut back to any token (KV, quantized,
        windows that have not wrapped) needs none: the list is empty. Else,
        Marconi-style: the junction where the prompt leaves a stored sequence
        it shares a prefix with (``stored_prefix``, at the exact token: the
        shared prefix's second sighting), the prompt's end minus
        ``checkpoint_tail`` tokens (an exact repeat, or a next turn whose
        template re-renders the last tokens, resumes there), and the snapshot
        interval's points (``layout.snapshot_interval`` blocks apart: prompts
        that will branch where nothing is stored yet). The scheduler loop::

            cache, n = pc.fetch(tokens)
            for stop in pc.checkpoints(tokens, n):
                ...prefill tokens[n:stop] into cache...; n = stop
                pc.capture(tokens[:stop], cache)
            ...prefill the rest, generate...
            pc.store(tokens + reply[:-1], cache)
        """
        data = nonempty(tokens)
        if not self.lookup.needs_checkpoints(len(data) // TOKEN_BYTES):
            return []
        with self._lock:
            self._check_open()
            shared = self._shared(data, self._root(extra))
        return self.lookup.checkpoints(len(data) // TOKEN_BYTES, num_cached, shared)

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
    ) -> int:
        """``store`` for a cache in the middle of a prefill, at a checkpoint: keeps the
        state at exactly ``len(tokens_so_far)`` (a tail carrying it, or the block
        ending there), with the window and chunk K/V a restore there needs.

        Raises:
            the errors of ``store``: a cache that does not hold exactly
            ``tokens_so_far`` cannot be kept there.
        """
        return self._store(tokens_so_far, cache, extra, session=session, persist=persist)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefill_step_size: int | None = None,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
    ) -> tuple[list[Any], mx.array]:
        """``fetch``, prefill the rest capturing at every checkpoint, ``store``.

        ``prefill_step_size`` (a multiple of ``block_size``; chunks also end on
        its multiples) defaults to about mlx-lm's 2048 tokens. Returns (cache,
        last logits).
        """
        from .prefill import prefill

        keep = {"extra": extra, "session": session, "persist": persist}
        return prefill(self, tokens, prefill_step_size=prefill_step_size, **keep)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """Report a prefill of ``num_tokens`` that took ``seconds`` (``prefill`` does;
        a scheduler with its own loop may): the remote tier's cost gate weighs
        fetching a prefix against recomputing it at this speed."""
        with self._lock:
            self.tiers.note_prefill(num_tokens, seconds)


def nonempty(tokens: Sequence[int]) -> bytes:
    """``tokens`` as uint32 bytes; a prompt needs at least one token."""
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data
