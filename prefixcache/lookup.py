"""Lookup: where a prompt stands in the tiers, how much of it a restore can give, the restore.

Metadata only: the chain is matched by key through the tiers (``Tiers.chain``)
and checked token by token (``restore.walk``); past it, a partial block (a
stored block the prompt diverges inside, or a tail) is picked from the children
every tier lists under the last match (``partial.best_child``) and loaded from
that tier. ``plan`` then finds the deepest prefix every layer can be rebuilt
at, leaving at least one token to prefill, before anything is copied;
``restore`` rebuilds it (restore.py), falling back to a shorter prefix when a
block cannot be loaded.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from .codecs import codec_for, round_up
from .config import CacheConfig
from .errors import MissReason, Shortfall
from .hashing import chain_keys
from .layout import ModelLayout
from .partial import Match, best_child
from .restore import plan, rebuild, walk
from .tiers.stack import Tiers


class Lookup:
    """Matching and restore planning for one PrefixCache (called under its lock)."""

    def __init__(self, config: CacheConfig, layout: ModelLayout, tiers: Tiers):
        self.config, self.layout, self.tiers = config, layout, tiers

    def match(self, data: bytes, root: bytes) -> Match:
        """How far the tiers hold the prompt ``data``: chain, then a partial block."""
        bs = self.config.block_size
        keys = chain_keys(root, data, bs)
        entries, owners = self.tiers.chain(keys)
        found = walk(entries, root, data, bs)
        depth, reason = found.depth, found.reason
        if reason is None and depth < len(keys):
            reason = self.tiers.missing_reason(keys[depth])
        rest = data[depth * bs * 4 :]
        # the prompt ends on the chain: no partial block to look for (no LMDB read)
        children = self.tiers.children(keys[depth - 1] if depth else root) if rest else []
        partial, owner, common = best_child(children, depth, rest)
        if partial is not None:
            keys, owners = [*keys[:depth], partial.key], [*owners[:depth], owner]
        return Match(keys, owners, depth, reason, partial, common)

    def usable(self, found: Match, depth: int, num_tokens: int) -> tuple[int, int]:
        """(blocks to restore, tokens cached) for ``depth`` blocks of ``found``'s keys:
        at least one token is left to prefill."""
        bs = self.config.block_size
        if depth > found.depth:  # through the partial block
            return depth, self.partial_tokens(found, num_tokens)
        if depth * bs < num_tokens:
            return depth, depth * bs
        if self.layout.trimmable_at(num_tokens - 1):
            return depth, num_tokens - 1
        return depth - 1, (depth - 1) * bs

    def partial_tokens(self, found: Match, num_tokens: int) -> int:
        """Tokens cached when restoring through ``found.partial`` (0: not usable).

        The partial block is cut back to the tokens the prompt shares with it,
        which every cache but recurrent state allows; recurrent state is
        restored only where the block (a tail) ends.
        """
        start = found.depth * self.config.block_size
        shared = min(found.common, num_tokens - 1 - start)
        if shared <= 0 or found.partial is None:
            return 0
        if shared * 4 == len(found.partial.tokens) or self.layout.trimmable_at(start + shared):
            return start + shared
        return 0

    def plan(self, found: Match, depth: int, num_tokens: int) -> tuple[int, int, MissReason | None]:
        """(blocks, tokens, reason) restorable given which payloads blocks hold."""
        keys = found.keys
        depth = min(depth, len(keys) if found.partial else found.depth)
        tiers, owners, known = self.tiers.all, found.owners, {}

        def names(index: int) -> Container[str] | None:
            if index not in known:  # None: unknown, the load checks it
                known[index] = tiers[owners[index]].payload_names(keys[index])
            return known[index]

        def usable(d: int) -> tuple[int, int]:
            blocks, tokens = self.usable(found, d, num_tokens)
            if d > found.depth and not tokens:  # the partial block is of no use
                return self.usable(found, found.depth, num_tokens)
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

    def restore(self, found: Match, num_tokens: int) -> tuple[list[Any], int, MissReason | None]:
        """(a fresh cache holding the deepest restorable prefix of ``found``, its
        tokens, why not more); a block that fails to load shortens the restore."""
        reason = None
        depth = found.depth + 1
        bs = self.config.block_size
        while depth > 0:
            num_blocks, num_cached, why = self.plan(found, depth, num_tokens)
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
        return make_prompt_cache(self.layout.model), 0, reason  # a miss: as mlx-lm makes it
