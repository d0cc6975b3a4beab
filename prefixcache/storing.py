"""The write verbs of a PrefixCache: ``store``, ``capture`` and ``prefill``.

A model's cache, holding exactly the tokens given, is cut into the blocks it
adds (every new full block, and the tail after the last one, each with every
layer's state at its exact end); they are kept in the tiers, tagged for their
session, and a tail's recurrent state supersedes the one it extends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx

from .capture import cut_blocks
from .config import CacheConfig
from .controls import Controls, check_session, tail_keys
from .hashing import chain_keys, token_bytes
from .layout import ModelLayout
from .stats import Stats
from .tiers.stack import Tiers


class StoreVerbs:
    """The write verbs of :class:`~prefixcache.cache.PrefixCache` (mixed into it).

    It uses the cache's ``config``, ``layout``, ``tiers``, ``controls``,
    ``_stats``, ``_lock``, ``_last_shared``, ``_root`` and ``_check_open``.
    """

    config: CacheConfig
    layout: ModelLayout
    tiers: Tiers
    controls: Controls
    _stats: Stats
    _lock: AbstractContextManager[object]
    _last_shared: tuple[bytes, bytes, int] | None

    def _root(self, extra: Mapping[str, str] | None) -> bytes: ...

    def _check_open(self) -> None: ...

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
    ) -> int:
        """Keep what ``cache`` (holding exactly ``tokens``) adds: every new full block
        and the tail (the tokens after the last full block), with every layer's
        state at the exact end. Returns how many new full blocks were kept.

        After generating, the cache holds the prompt and every generated token
        but the last: ``store(tokens + generated[:-1], cache)``. The next turn
        of a conversation then resumes from there on every layout.
        ``session`` tags the blocks only this session holds (``end_session``
        drops them); ``persist=False`` keeps them hot only, never written to a
        lower tier (docs/operating.md).

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        return self._store(tokens, cache, extra, session=session, persist=persist)

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

    def _store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        extra: Mapping[str, str] | None,
        *,
        session: str | None,
        persist: bool,
    ) -> int:
        data = token_bytes(tokens)
        check_session(session)
        with self._lock:
            self._check_open()
            self.layout.validate(cache, len(data) // 4)
            root = self._root(extra)
            bs = self.config.block_size
            keys = chain_keys(root, data, bs)
            cut = cut_blocks(
                keys,
                root,
                data,
                cache,
                block_size=bs,
                snapshot_interval=self.layout.snapshot_interval,
                stored=self.tiers.contains,
                resident=self.tiers.hot.get,
                window=self.layout.window_policy,
            )
            self._last_shared = None  # what is stored changed
            tail = cut.tail
            continues = self.tiers.continues([*cut.new, *([tail] if tail else [])])
            self.tiers.keep(cut.new, persist=persist, continues=continues)
            self.tiers.replace(cut.upgraded)
            if tail is not None:
                self.tiers.keep_tail(tail, persist=persist, continues=continues)
            walked = [*keys, *tail_keys(root, keys, data, bs)]
            self.controls.stored(session, persist, [*cut.new, *([tail] if tail else [])], walked)
            if self.layout.trimmable_at(1):  # recurrent state: a tail's end state is its own
                for block in [*cut.new[-1:], *([tail] if tail else [])]:
                    self.tiers.hot.drop_superseded(block)
            self._stats.num_stores += 1
            return len(cut.new)
