"""The operator verbs of a PrefixCache: pin, unpin, end_session, trim_hot.

The public face of controls.py (which acts on the tiers); mixed into
:class:`~prefixcache.cache.prefix_cache.PrefixCache`, whose lock each verb holds. What
each control does, and its serve flags and ``PREFIXCACHE_*`` variables, is in
docs/operating.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..config import CacheConfig
from ..hashing import chain_keys, token_bytes
from ..memory import give_back
from ..tiers.controls import Controls, tail_keys
from ..tiers.hot.tier import HotTier
from ..tiers.pins import pin_until
from ..tiers.stack import TierStack
from .layout import ModelLayout
from .lookup import Lookup


class ControlVerbs:
    """The operator verbs of :class:`~prefixcache.cache.prefix_cache.PrefixCache` (mixed into it).

    ``pin``, ``unpin``, ``end_session``, ``trim_hot``, and its tiers (``hot``,
    ``ssd``). It uses the cache's ``controls``, ``tiers``, ``config``,
    ``layout``, ``lookup``, ``_lock``, ``_last_keys``, ``_root`` and ``_check_open``.
    """

    config: CacheConfig
    controls: Controls
    tiers: TierStack
    layout: ModelLayout
    lookup: Lookup
    _lock: AbstractContextManager[object]
    _last_keys: tuple[bytes, bytes, list[bytes]] | None  # the last fetch's (prompt, root, keys)

    def _root(self, extra: Mapping[str, str] | None) -> bytes: ...

    def _check_open(self) -> None: ...

    def pin(
        self,
        tokens: Sequence[int],
        ttl: float | None = None,
        *,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """Keep the stored blocks of ``tokens`` in every tier until the pin ends.

        Pinned blocks are never evicted from hot nor from the SSD tier (a block
        held only below hot is loaded into hot; one not yet on the SSD tier is
        written now); their bytes count against each tier's cap. ``ttl``
        (seconds) ends the pin, not the blocks; pins are kept in the SSD
        index, so they survive a restart. Pinning again sets a new end.

        Returns:
            tokens pinned: those of the stored chain of ``tokens`` (and of its
            stored tail); 0 if nothing of it is stored.

        Raises:
            ValueError: ``tokens`` is empty, or ``ttl`` is not > 0.
            PinCapacityError: a tier's pinned bytes would pass its cap (nothing changes).
        """
        data = token_bytes(tokens)
        if not data:
            raise ValueError("cannot pin an empty prompt: tokens is empty")
        until = pin_until(ttl, time.time())
        with self._lock:
            self._check_open()
            pinned = self.controls.pin(self._keys(data, extra), until)
            return sum(b.num_tokens for b in pinned)

    def unpin(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """End the pins of the blocks of ``tokens`` (they stay, evictable again);
        returns how many blocks were pinned."""
        data = token_bytes(tokens)
        if not data:
            raise ValueError("cannot unpin an empty prompt: tokens is empty")
        with self._lock:
            self._check_open()
            return self.controls.unpin(self._keys(data, extra))

    def end_session(self, session: str) -> int:
        """Drop at once, from every tier, the blocks only ``session`` holds (prefixes
        another store shares stay, and so do pinned blocks); returns how many.

        Raises:
            ValueError: unknown ``session`` (no store used it, or it ended).
        """
        with self._lock:
            self._check_open()
            held = self.tiers.hot.nbytes
            num = self.controls.end(session)
            give_back.note_freed(held - self.tiers.hot.nbytes)  # removed, not evicted
        give_back.maybe()
        return num

    @property
    def hot(self) -> HotTier:
        return self.tiers.hot

    @property
    def ssd(self) -> Any:
        """The SSD tier, or None (``hot_cache_only``)."""
        return self.tiers.named("ssd")

    def trim_hot(
        self,
        max_bytes: int,
        *,
        first: Sequence[int] | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """Evict hot blocks (leaves first, pinned ones kept) until at most
        ``max_bytes`` are held; dirty blocks spill as on any eviction. Returns how
        many blocks left the hot tier.

        ``first``: the tokens of a request in flight whose cache will be stored
        when it ends. Its restored chain is held twice meanwhile (in hot and in
        the request's cache), so its blocks go first, deepest first, where the
        store puts each of them back into hot from the cache: every layer can be
        cut back, and no lower tier holds them (with one, they spill there, the
        store skips them as stored, and the request's next turn reads them back:
        the policy's own choice keeps them hot instead); then the policy's choice.
        """
        limit = max(0, max_bytes)
        with self._lock:
            num = 0
            hot = self.tiers.hot
            if hot.nbytes <= limit:
                return 0
            if first and not self.layout.checkpointed and not self.tiers.lower:
                data, root = token_bytes(first), self._root(extra)
                last = self._last_keys  # the blocks its fetch restored, else the plan again
                same = last is not None and last[0] == data and last[1] == root
                keys = last[2] if same else self.lookup.plan(data, root).keys
                num = hot.evict_chain(reversed(keys), limit)
            num += hot.evict_to(limit)
        give_back.maybe()  # the evicted arrays are unreferenced now (memory/give_back.py)
        return num

    def _keys(self, data: bytes, extra: Mapping[str, str] | None) -> list[bytes]:
        """Chain keys of ``data``'s full blocks, then its tail's key if it has one."""
        root = self._root(extra)
        keys = chain_keys(root, data, self.config.block_size)
        return [*keys, *tail_keys(root, keys, data, self.config.block_size)]
