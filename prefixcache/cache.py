"""PrefixCache: the facade a scheduler calls around its prefill. Policy lives here."""

from __future__ import annotations

import threading
from collections.abc import Container, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .blocks import Block
from .capture import cut_blocks
from .codecs import codec_for, round_up
from .config import CacheConfig
from .errors import MissReason, Shortfall
from .hashing import Namespace, chain_keys, token_bytes
from .layout import ModelLayout
from .model_id import model_fingerprint
from .partial import Match, best_child
from .periodic import Periodic
from .restore import plan, rebuild, walk
from .stats import Stats, counter_delta
from .tiers import lower_tiers
from .tiers.base import Tier
from .tiers.hot import HotTier
from .tiers.stack import Tiers


class PrefixCache:
    """A tiered, block-aware prefix cache for one model.

    Args:
        model: the mlx-lm model whose caches are stored.
        config: settings; defaults to ``CacheConfig.from_env()``.
        model_id: identity of the weights (e.g. "org/name@revision"); when
            omitted, a fingerprint of the weights is used.
        tiers: the tiers below hot, in lookup order, instead of those the
            config builds (e.g. a tier of another package); they are closed
            with the cache.
    """

    def __init__(
        self,
        model: nn.Module,
        config: CacheConfig | None = None,
        *,
        model_id: str | None = None,
        tiers: Sequence[Tier] | None = None,
    ):
        self.model = model
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.RLock()
        self._stats = Stats()
        self.layout = ModelLayout(model, self.config)
        self.namespace = Namespace(
            model_id or model_fingerprint(model), self.layout.signature, self.layout.kv_quant
        )
        self._roots: dict[tuple[tuple[str, str], ...], bytes] = {}
        lower = lower_tiers(self.config) if tiers is None else list(tiers)
        shed = self.layout.without_state if self.layout.state_prefixes else None
        self.tiers = Tiers(self.config, self._stats, lower, shed)
        self._saved: dict[str, object] = self._stats.as_dict()  # counters as last saved
        self._closed = False
        seconds = self.config.counters_save_seconds
        self._saver = (  # a killed process loses at most `seconds` of counters
            Periodic(seconds, self._save_counters_now, "prefixcache-counters")
            if seconds > 0 and self.tiers.lower
            else None
        )

    @property
    def hot(self) -> HotTier:
        return self.tiers.hot

    @property
    def ssd(self) -> Any:
        """The SSD tier, or None (``hot_cache_only``)."""
        return self.tiers.named("ssd")

    # -- public API -------------------------------------------------------

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> tuple[list[Any], int]:
        """A fresh cache holding the longest cached prefix of ``tokens``.

        Full blocks of the chain, then the part of a stored block or tail the
        prompt shares (see :class:`Match`). Always leaves at least one token to
        prefill.

        Returns:
            (cache list for the model, number of tokens it holds)
        """
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self._match(data, extra)
            num_tokens = len(data) // 4
            cache, num_cached, reason = self._restore(found, num_tokens)
            reason = reason or found.reason
            shared = found.depth * self.config.block_size + found.common
            if reason is None and num_cached < min(shared, num_tokens - 1):
                reason = MissReason.PARTIAL_BLOCK  # a stored block shared more, unusably
            self._stats.fetched(num_tokens, num_cached, reason)
            return cache, num_cached

    def match(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Tokens ``fetch`` would restore (from the index only; restores nothing)."""
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self._match(data, extra)
            return self._plan(found, found.depth + 1, len(data) // 4)[1]

    def stored_prefix(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Tokens of ``tokens`` some stored sequence shares, restorable or not.

        Where this exceeds ``match`` on a model with recurrent layers, the
        stored sequences branch there without state to resume from: a
        scheduler that calls ``store`` at the block boundary below it
        (as ``prefill`` does) lets the next prompt branching there hit.
        """
        data = _nonempty(tokens)
        with self._lock:
            self._check_open()
            found = self._match(data, extra)
            return found.depth * self.config.block_size + found.common

    def store(
        self, tokens: Sequence[int], cache: Sequence[Any], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Keep every new full block of ``cache`` (returns how many) and its tail.

        ``cache`` is a finished sequence: every layer's state at its exact end
        is kept (the tail, the tokens after the last full block, as a tail
        block; recurrent state with the block or tail ending there), so the
        next turn of a conversation reuses all of this one, recurrent models
        included.

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        return self._store(tokens, cache, extra, at_end=True)

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """``store`` for a cache being prefilled: call it after every chunk.

        Window K/V are cut before the window moves on and recurrent state every
        ``snapshot_interval`` blocks (see capture.py); e.g. from
        ``generate_step``'s ``prompt_progress_callback`` (``prefill_step_size``
        a multiple of ``block_size``; skip its last call, ``done == total``,
        made once the first generated token is in the cache). Call ``store``
        once the sequence is complete: it keeps the state at its end.
        """
        return self._store(tokens_so_far, cache, extra, at_end=False)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefill_step_size: int | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[list[Any], mx.array]:
        """``fetch``, prefill the rest in block-aligned chunks, ``capture`` each.

        ``prefill_step_size`` (a multiple of ``block_size``; chunks end on its
        multiples) defaults to the snapshot interval (``layout.snapshot_interval``) for models with
        recurrent layers, else ~2048 tokens. Returns (cache, last logits).
        """
        from .prefill import prefill

        return prefill(self, tokens, prefill_step_size=prefill_step_size, extra=extra)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """Report a prefill of ``num_tokens`` that took ``seconds`` (``prefill`` does;
        a scheduler with its own loop may): the remote tier's cost gate weighs
        fetching a prefix against recomputing it at this speed."""
        with self._lock:
            self.tiers.note_prefill(num_tokens, seconds)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self._stats.as_dict() | self.tiers.snapshot()

    def flush(self) -> None:
        """Persist every dirty hot block to the lower tiers and wait for their writes."""
        with self._lock:
            self.tiers.flush()
            self._save_counters()

    def trim_hot(self, max_bytes: int) -> int:
        """Evict LRU hot blocks (leaves first) until at most ``max_bytes`` are held.

        Dirty blocks spill to the lower tiers as on any eviction. Returns how
        many blocks left the hot tier.
        """
        with self._lock:
            return self.hot.evict_to(max(0, max_bytes))

    def close(self) -> None:
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.stop()  # not under the lock: its last call may be waiting for it
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.tiers.flush()
                self._save_counters()
            finally:
                self.tiers.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        extra: Mapping[str, str] | None,
        *,
        at_end: bool,
    ) -> int:
        data = token_bytes(tokens)
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
                at_end=at_end,
                stored=self.tiers.contains,
                resident=self.hot.get,
            )
            self.tiers.keep(cut.new)
            self.tiers.replace(cut.upgraded)
            tail = cut.tail
            if tail is not None:
                self.tiers.keep_tail(tail)
            for block in [*cut.new[-1:], *([tail] if tail else [])]:
                self._drop_superseded(block)
            self._stats.num_stores += 1
            return len(cut.new)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixCache is closed")

    def _root(self, extra: Mapping[str, str] | None) -> bytes:
        items = tuple(sorted(extra.items())) if extra else ()
        root = self._roots.get(items)
        if root is None:
            namespace = self.namespace.with_extra(extra)
            root = self._roots[items] = namespace.root_key()
            # once per root per process: `prefixcache stats` per model
            self.tiers.note_namespace(root, namespace.to_json())
        return root

    def _save_counters_now(self) -> None:
        with self._lock:
            if not self._closed:
                self._save_counters()

    def _save_counters(self) -> None:
        """Add the counters since the last save to the lower tiers' record of this model."""
        now = self._stats.as_dict()
        self.tiers.save_counters(self._root(None), counter_delta(now, self._saved))
        self._saved = now

    def _match(self, data: bytes, extra: Mapping[str, str] | None) -> Match:
        """How far the tiers hold the prompt ``data``: chain, then a partial block."""
        root = self._root(extra)
        bs = self.config.block_size
        keys = chain_keys(root, data, bs)
        entries, owners = self.tiers.chain(keys)
        found = walk(entries, root, data, bs)
        depth, reason = found.depth, found.reason
        if reason is None and depth < len(keys):
            reason = self.tiers.missing_reason(keys[depth])
        partial, common = best_child(
            self.hot.children(keys[depth - 1] if depth else root), depth, data[depth * bs * 4 :]
        )
        if partial is not None:
            keys, owners = [*keys[:depth], partial.key], [*owners[:depth], 0]
        return Match(keys, owners, depth, reason, partial, common)

    def _usable(self, found: Match, depth: int, num_tokens: int) -> tuple[int, int]:
        """(blocks to restore, tokens cached) for ``depth`` blocks of ``found``'s keys:
        at least one token is left to prefill."""
        bs = self.config.block_size
        if depth > found.depth:  # through the partial block
            return depth, self._partial_tokens(found, num_tokens)
        if depth * bs < num_tokens:
            return depth, depth * bs
        if self.layout.trimmable_at(num_tokens - 1):
            return depth, num_tokens - 1
        return depth - 1, (depth - 1) * bs

    def _partial_tokens(self, found: Match, num_tokens: int) -> int:
        """Tokens cached when restoring through ``found.partial`` (0: not usable).

        The partial block is cut back to the tokens the prompt shares with it,
        which every cache but recurrent state allows; recurrent state is
        restored only where the block (a tail) ends.
        """
        start = found.depth * self.config.block_size
        shared = min(found.common, num_tokens - 1 - start)
        if shared <= 0 or found.partial is None:
            return 0
        if shared == found.partial.num_tokens or self.layout.trimmable_at(start + shared):
            return start + shared
        return 0

    def _plan(
        self, found: Match, depth: int, num_tokens: int
    ) -> tuple[int, int, MissReason | None]:
        """(blocks, tokens, reason) restorable given which payloads blocks hold."""
        keys = found.keys
        depth = min(depth, len(keys) if found.partial else found.depth)
        hot = self.hot.get

        def names(index: int) -> Container[str] | None:
            block = hot(keys[index])
            return None if block is None else block.arrays  # lower tiers: checked on load

        def usable(d: int) -> tuple[int, int]:
            blocks, tokens = self._usable(found, d, num_tokens)
            if d > found.depth and not tokens:  # the partial block is of no use
                return self._usable(found, found.depth, num_tokens)
            return blocks, tokens

        if not self.layout.needs_capture:  # every payload is always cut: nothing to check
            blocks, tokens = usable(depth) if depth > 0 else (0, 0)
            return (blocks, tokens, None) if blocks > 0 else (0, 0, None)
        template = self.layout.template  # its settings are all the checks read
        return plan(
            depth,
            usable=usable,
            fresh=lambda _: template,
            payload=names,
            block_size=self.config.block_size,
        )

    def _restore(self, found: Match, num_tokens: int) -> tuple[list[Any], int, MissReason | None]:
        reason = None
        depth = found.depth + 1
        bs = self.config.block_size
        while depth > 0:
            num_blocks, num_cached, why = self._plan(found, depth, num_tokens)
            reason = reason or why
            if num_blocks <= 0:
                break
            fresh = self.layout.fresh(num_cached)
            loader = self.tiers.chain_load(found.keys, found.owners)
            try:
                cache = rebuild(
                    fresh,
                    [codec_for(c) for c in fresh],
                    loader,
                    num_blocks=num_blocks,
                    num_tokens=num_cached,
                    # a partial block is copied whole, then cut back by the offset
                    capacity=round_up(
                        max(num_tokens + self.config.restore_headroom, num_blocks * bs)
                    ),
                    block_size=bs,
                )
            except Shortfall as short:
                depth, reason = short.index, reason or short.reason
                continue
            self.tiers.after_hit(found.keys[:num_blocks], loader.loaded)
            return cache, num_cached, reason
        return make_prompt_cache(self.model), 0, reason

    def _drop_superseded(self, block: Block) -> None:
        """Drop hot tails that ``block`` extends: cutting ``block`` back gives the same.

        Not for recurrent layers: a tail's state at its own end is what it adds.
        """
        if not self.layout.trimmable_at(1):
            return
        for other in self.hot.children(block.parent):
            if other.num_tokens < block.num_tokens and block.tokens.startswith(other.tokens):
                self.hot.remove([other.key])


def _nonempty(tokens: Sequence[int]) -> bytes:
    data = token_bytes(tokens)
    if not data:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    return data
