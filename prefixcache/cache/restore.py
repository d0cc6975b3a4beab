"""Restore: rebuild a :class:`~prefixcache.cache.lookup.Plan` into caches at their final length.

Every layer gets ONE buffer (the prompt's length plus headroom) filled block by
block, so the suffix prefill writes in place. Each block comes from the tier
the plan names (:class:`ChainLoad`). Hot blocks' buffers are allocated in one
evaluation and copied into (``Copies``: on a few threads when large). Lower
tiers stream theirs: the buffers are allocated, unwritten, from the first
streamed block's header, and the tier's reader writes each tensor straight
into its buffer (``place``); tensors without a destination come as HostArrays
(views of a read buffer). A block that fails to load is excluded and the next
plan tried. Lower-tier blocks worth promoting are listed
(``Restored.promote``) for the caller to load into the tiers above off the
request's path, so the request pays for one copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..blocks import split_layers
from ..codecs import Builder, Codec, Resident, codec_for
from ..codecs.placing import placer
from ..errors import LayoutMismatchError, MissReason, Shortfall
from ..hashing import TOKEN_BYTES
from ..memory.copies import Copies
from ..memory.host import HostArray, Place, Placed, PlacedRun
from ..memory.restore_buffers import batched
from ..memory.runs import coalesce
from ..tiers.base import Tier, TierReader
from ..tiers.stack import TierStack
from .ahead import reserve_ahead
from .lookup import Lookup, Plan


@dataclass(frozen=True, slots=True)
class Restored:
    """What a fetch restored: the cache, its tokens, why not more, the shared prefix,
    the keys of the blocks it was rebuilt from."""

    cache: list[Any]
    num_tokens: int
    reason: MissReason | None
    shared: int
    keys: list[bytes]
    promote: list[tuple[int, Tier, int]]  # lower-tier blocks to promote: (index, tier, bytes)


def restore(lookup: Lookup, data: bytes, root: bytes, *, headroom: int) -> Restored:
    """A fresh cache holding the deepest restorable prefix of the prompt ``data``.

    The lookup's plan is rebuilt; a block that fails to load is excluded and the
    next plan tried. Lower-tier blocks loaded are listed for promotion.
    """
    tiers, layout, bs = lookup.tiers, lookup.layout, lookup.config.block_size
    exclude: set[bytes] = set()
    reason, shared = None, None
    while True:
        plan = lookup.plan(data, root, exclude=exclude)
        shared = plan.shared if shared is None else shared
        reason = reason or plan.reason
        if not plan.num_tokens:  # a miss: the cache as mlx-lm makes it
            return Restored(make_prompt_cache(layout.model), 0, reason, shared, [], [])
        fresh = layout.fresh(plan.num_tokens)
        if not headroom and tiers.hot.recent and all(t is tiers.hot for t in plan.tiers):
            # a sequence the hot tier keeps whole holds it: views of its arrays, no copy
            prefix = data[: plan.num_tokens * TOKEN_BYTES]
            cache = tiers.hot.recent.restore(root, prefix, fresh)  # None: ``fresh`` untouched
            if cache is not None:
                tiers.touch_chain(plan.keys)
                return Restored(cache, plan.num_tokens, reason, shared, plan.keys, [])
        loader = ChainLoad(tiers, plan)
        # a block cut back is copied whole: the buffers hold every block. With headroom,
        # room for the prompt's rest and as many tokens more (mlx-lm grows a full
        # buffer in its 256-token steps); without, the restored blocks only
        whole = len(plan.entries) * bs
        capacity = max(len(data) // TOKEN_BYTES + headroom, whole) if headroom else whole
        try:
            cache = rebuild(fresh, loader, capacity=capacity, block_size=bs)
        except Shortfall as short:
            exclude.add(plan.entries[short.index].key)
            reason = reason or short.reason
            continue
        tiers.touch_chain(plan.keys)
        return Restored(cache, plan.num_tokens, reason, shared, plan.keys, loader.promote)


class ChainLoad:
    """Loads the blocks of one plan in chain order, each from the tier that holds it.

    ``promote`` lists the lower-tier blocks worth promoting (``TierStack.promotable``:
    into hot while it has room, and onto the lower tiers above their own, e.g. a
    remote hit kept on ssd), when ``promote`` is on.
    """

    def __init__(self, tiers: TierStack, plan: Plan):
        self.stack, self.plan = tiers, plan
        self.keys = plan.keys
        self.promote: list[tuple[int, Tier, int]] = []
        hot = tiers.hot
        self._room = hot.room if tiers.config.promote else 0
        self._readers: dict[Tier, TierReader] = {}

    def specs(self, index: int) -> Mapping[str, Placed] | None:
        """Block ``index``'s tensors' dtypes and shapes, if its tier (not one held
        in memory) knows them before loading it; else None."""
        tier = self.plan.tiers[index]
        return None if tier.resident else self._reader(tier).first_shapes([index])

    def start(self, order: list[int], place: Place | None) -> None:
        """Start every lower tier's reader on its blocks of ``order``."""
        tiers = self.plan.tiers
        for tier in dict.fromkeys(tiers[i] for i in order):
            if not tier.resident:
                self._reader(tier).prepare([i for i in order if tiers[i] is tier], place)

    def payload(self, index: int) -> tuple[Mapping[str, Any], bool]:
        """(block ``index``'s flat payload, whether it stays in memory anyway).

        Raises:
            Shortfall: the tier could not load it.
        """
        tier = self.plan.tiers[index]
        reader = self._reader(tier)
        block = reader.load(index)
        if block is None:
            raise Shortfall(index, reader.miss(index))
        self.stack.stats.block_hit(tier.name)
        promote = self.stack.config.promote and not tier.resident
        if promote and (self.stack.above(tier) or block.nbytes <= self._room):
            self._room -= block.nbytes
            self.promote.append((index, tier, block.nbytes))
        return block.arrays, tier.resident

    def residents(self, order: Sequence[int]) -> dict[int, Resident]:
        """Blocks ``order``, all of tiers that keep them in memory (hot): each one's
        payload and the host bytes of its arrays, counted as hits (none promoted).

        Raises:
            Shortfall: a block left its tier since the plan (another thread evicted it).
        """
        tiers, stats = self.plan.tiers, self.stack.stats
        out: dict[int, Resident] = {}
        for index in order:
            tier = tiers[index]
            reader = self._reader(tier)
            block = reader.load(index)
            if block is None:
                raise Shortfall(index, reader.miss(index))
            stats.block_hit(tier.name)
            views = reader.host_views(index)
            out[index] = (block.arrays, {} if views is None else views)
        return out

    def stop(self) -> None:
        """Stop every reader (and wait for its threads); safe to call more than once."""
        for reader in self._readers.values():
            reader.close()

    def _reader(self, tier: Tier) -> TierReader:
        reader = self._readers.get(tier)
        if reader is None:
            reader = self._readers[tier] = tier.reader(self.keys)
        return reader


Checked = tuple[frozenset[str], tuple[int, ...]]  # a placed block's names and layers


def rebuild(fresh: list[Any], loader: ChainLoad, *, capacity: int, block_size: int) -> list[Any]:
    """Fill every layer of ``fresh`` from the blocks of ``loader``'s plan.

    Args:
        fresh: empty caches from make_prompt_cache (quantized where due).
        loader: loads the plan's blocks; stopped (success or not) before the buffers go.
        capacity, block_size: buffer length and block length, in tokens.

    Raises:
        Shortfall: a block (or a layer's part of it) is unusable.
    """
    plan, num_tokens, codecs = loader.plan, loader.plan.num_tokens, [codec_for(c) for c in fresh]
    builders = [codec_for(f).builder(f, num_tokens, capacity, block_size) for f in fresh]
    users, alike = _users(codecs, fresh, num_tokens, block_size)
    if users and max(users) >= len(plan.entries):
        raise ValueError(f"{num_tokens} tokens need block {max(users)} of {len(plan.entries)}")
    order = sorted(users)
    try:
        if order and all(plan.tiers[i].resident for i in order):
            _add_resident(builders, alike, order, loader)
        else:
            reserve_ahead(builders, users, order, plan, loader.specs)
            loader.start(order, placer(builders, users))
            checked: set[Checked] = set()
            for index in order:
                _add_block(builders, users, index, *loader.payload(index), checked)
    finally:
        loader.stop()
    with batched(mx.cpu) as batch:  # every buffer still to make, in one load
        lazy = [b.allocate() for b in builders]
    mx.eval(lazy, batch.arrays)
    copies = Copies()  # the hot blocks' copies: on a few threads when large
    for b in builders:
        b.queue_copies(copies)
    copies.wait()
    caches = [b.finish() for b in builders]
    mx.eval([c.state for c in caches])
    return caches


Needs = dict[Sequence[int], list[int]]  # blocks needed -> the layers needing just those


def _users(
    codecs: Sequence[Codec], fresh: Sequence[Any], num_tokens: int, block_size: int
) -> tuple[dict[int, list[int]], Needs]:
    """(chain index -> the layers that need that block, the blocks needed -> the
    layers needing them: every K/V layer needs the same ones, and is added with the
    others)."""
    alike: Needs = {}
    for layer, (codec, cache) in enumerate(zip(codecs, fresh, strict=True)):
        needed = codec.blocks_needed(cache, num_tokens, block_size)
        alike.setdefault(needed if isinstance(needed, range) else tuple(needed), []).append(layer)
    users: dict[int, list[int]] = {}
    for needed, layers in alike.items():
        for index in needed:
            users.setdefault(index, []).extend(layers)
    if len(alike) > 1:
        for layers in users.values():
            layers.sort()
    return users, alike


def _add_resident(
    builders: list[Builder], alike: Needs, order: list[int], loader: ChainLoad
) -> None:
    """Blocks all held in memory: each layer's builder takes them together where it
    can (``Builder.add_resident``: one copy per buffer), else one at a time (each
    block's payload split by layer once, when first needed). For the layers that
    take the same blocks (``alike``: every K/V layer; a window's layers their last
    ones), a run's consecutive blocks are merged where the run holds those layers
    (one copy each). The work is per group of layers and per run, not per block and
    layer."""
    resident = loader.residents(order)
    split: dict[int, dict[int, dict[str, Any]]] = {}
    for needed, group in alike.items():
        indices = needed if isinstance(needed, range) else sorted(needed)
        if not indices:
            continue
        blocks = coalesce([resident[i] for i in indices], frozenset(group))
        for layer in group:
            if builders[layer].add_resident(indices, blocks, f"{layer}."):
                continue
            for i in indices:
                if i not in split:
                    split[i] = split_layers(resident[i][0])
            builders[layer].add_each(indices, [split[i].get(layer, {}) for i in indices])


def _add_block(
    builders: list[Builder],
    users: dict[int, list[int]],
    index: int,
    arrays: Mapping[str, Any],
    resident: bool,
    checked: set[Checked],
) -> None:
    """Hand block ``index``'s payload to the builders of the layers that use it. A
    block read wholly into place with an earlier one's names and layers (``checked``)
    needs nothing more where ``add`` only checks names (``placed_checks_only``)."""
    mine = users[index]
    # a block read wholly into place by host-taking builders leaves no MLX work
    placed = type(arrays) is PlacedRun or all(type(a) is Placed for a in arrays.values())
    only_checks = placed and all(builders[i].placed_checks_only for i in mine)
    seen = (frozenset(arrays), tuple(mine)) if only_checks else None
    if seen in checked:
        return
    layers = split_layers(arrays)
    streamed = not resident and not (placed and all(builders[i].takes_host for i in mine))
    if streamed:  # allocate every layer's buffer (unwritten) before the copies
        with batched(mx.cpu) as batch:
            lazy = [builders[i].reserve(index, layers.get(i, {})) for i in mine]
        mx.async_eval(lazy, batch.arrays)
    for layer in mine:
        builder, part = builders[layer], layers.get(layer, {})
        if not builder.takes_host:
            part = {
                n: a.to_mx() if isinstance(a, HostArray | Placed) else a for n, a in part.items()
            }
        try:
            builder.add(index, part)
        except (LayoutMismatchError, KeyError) as err:
            raise Shortfall.of(index, err) from err
    if streamed:
        mx.eval([b.buffers() for b in builders])
    if seen is not None:
        checked.add(seen)
