"""Lookup: where a prompt stands in the tiers, and the deepest prefix a restore can give.

Metadata only: nothing is loaded. The prompt's full blocks are matched by
chain key through the tiers (``TierStack.chain``) and checked token by token.
Then restore points are tried deepest first, level by level from the end of
the matched chain back to the root. At each level (a matched block, or the
root) they are:

- the children some tier lists under it (tails: the last tokens of a stored
  sequence or a checkpoint, carrying every layer's state there; blocks of
  sequences that diverge there): at the end of a child the prompt shares
  whole, or cut back to the tokens it shares where every layer allows it
  (KV, quantized, windows, chunks: not recurrent state);
- the block boundary itself (the chain up to that block).

A point is restorable when every layer finds what it needs in the blocks it
would be rebuilt from (a recurrent snapshot where it ends, the window's or
chunk's K/V before it: ``Codec.missing``), judged from the payload names the
tiers list. The first restorable point is the :class:`Plan`; a block that
then fails to load is excluded by the caller and the search runs again
(``plan(..., exclude=...)``).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from ..config import CacheConfig
from ..errors import MissReason
from ..hashing import TOKEN_BYTES, chain_keys, common_tokens
from ..tiers.base import ChainEntry, Tier
from ..tiers.stack import TierStack
from .layout import ModelLayout


@dataclass(frozen=True, slots=True)
class Plan:
    """A restore chosen from metadata, handed to the rebuild.

    Attributes:
        entries: the blocks to load, root-first: chain blocks, and as the last
            one possibly a child (a tail, or a block the prompt diverges inside).
        tiers: the tier each entry is loaded from.
        num_tokens: tokens the restored cache holds (0: nothing is restorable).
        shared: tokens of the prompt that some stored sequence shares.
        reason: why fewer than ``shared`` (at most the prompt minus one) are
            restored, or None.
    """

    entries: tuple[ChainEntry, ...]
    tiers: tuple[Tier, ...]
    num_tokens: int
    shared: int
    reason: MissReason | None

    @property
    def keys(self) -> list[bytes]:
        return [e.key for e in self.entries]


@dataclass(frozen=True, slots=True)
class Nearest:
    """The stored sequence nearest a prompt, from the tiers' metadata (``Lookup.nearest``).

    Attributes:
        keys: the chain keys of the prompt's full blocks.
        depth: how many of them the tiers hold, matched token by token.
        reason: why the chain stops there (the next block's miss reason), or None.
        child: what a tier lists under the chain's end sharing the most tokens
            with the prompt after it (a tail, or a block the prompt diverges
            inside), or None; ``common``: the tokens it shares.
    """

    keys: list[bytes]
    depth: int
    reason: MissReason | None
    child: ChainEntry | None
    common: int


@dataclass(frozen=True, slots=True)
class _Point:
    """A candidate restore point: ``num_tokens`` from the chain's first ``depth``
    blocks and, if any, ``child`` (held by ``tier``); ``cut`` when the last block
    holds more tokens than the point (the layers must allow cutting it back)."""

    num_tokens: int
    depth: int
    child: ChainEntry | None = None
    tier: Tier | None = None
    cut: bool = False


@dataclass(slots=True)
class _Standing:
    """The prompt's matched chain: entries, the tier of each, why it stops."""

    data: bytes
    root: bytes
    keys: list[bytes]
    entries: list[ChainEntry]
    tiers: list[Tier]
    reason: MissReason | None
    children: dict[int, list[tuple[ChainEntry, Tier]]] = field(default_factory=dict)


class Lookup:
    """Matching and restore planning for one PrefixCache (called under its lock)."""

    def __init__(self, config: CacheConfig, layout: ModelLayout, tiers: TierStack):
        self.config, self.layout, self.tiers = config, layout, tiers
        # the last plan's prompt, root, keys, matched depth, reason (for ``nearest``;
        # no entries: they would keep evicted hot blocks' arrays alive)
        self._last: tuple[bytes, bytes, list[bytes], int, MissReason | None] | None = None

    def plan(self, data: bytes, root: bytes, *, exclude: Container[bytes] = ()) -> Plan:
        """The deepest restorable prefix of the prompt ``data`` (uint32 bytes),
        leaving at least one token to prefill; ``exclude``: keys not to use."""
        stand = self._stand(data, root, exclude)
        if not exclude:
            self._last = (data, root, stand.keys, len(stand.entries), stand.reason)
        limit = len(data) // TOKEN_BYTES - 1
        shared = self._shared(stand)
        reason, deepest = None, 0  # why the deepest point failed, and its tokens
        names: dict[bytes, Container[str] | None] = {}
        chosen = None
        for point in self._points(stand, limit, exclude):
            why = self._why_not(stand, point, names)
            if why is None:
                chosen = point
                break
            if reason is None:
                reason, deepest = why, point.num_tokens
        num_tokens = chosen.num_tokens if chosen else 0
        if num_tokens >= deepest:  # another candidate as deep served
            reason = None
        reason = reason or stand.reason
        if reason is None and num_tokens < min(shared, limit):
            reason = MissReason.PARTIAL_BLOCK
        if chosen is None:
            return Plan((), (), 0, shared, reason)
        return self._plan(stand, chosen, shared, reason)

    def needs_checkpoints(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` has layers that cannot be cut back."""
        layout = self.layout
        if not layout.checkpointed:
            return False
        return bool(layout.state_prefixes) or not layout.fits_window(num_tokens)

    def checkpoints(self, num_tokens: int, num_cached: int, shared: int) -> list[int]:
        """Checkpoints of a prompt of ``num_tokens`` restored at ``num_cached`` that
        shares ``shared`` with stored sequences (see ``PrefixCache.checkpoints``)."""
        points = {shared, num_tokens - self.config.checkpoint_tail}
        points.update(
            self.layout.restore_points.between(num_cached, num_tokens, self.config.block_size)
        )
        return sorted(p for p in points if num_cached < p < num_tokens)

    def nearest(self, data: bytes, root: bytes, *, again: bool = False) -> Nearest:
        """Where the prompt ``data`` leaves the stored sequences (for ``explain``);
        ``again``: nothing was stored since the last plan, which may be of it (its
        matched chain is taken as it was)."""
        last = self._last
        if again and last is not None and last[0] == data and last[1] == root:
            keys, depth, reason = last[2], last[3], last[4]
        else:
            stand = self._stand(data, root, ())
            keys, depth, reason = stand.keys, len(stand.entries), stand.reason
        rest = data[depth * self.config.block_size * TOKEN_BYTES :]
        parent = keys[depth - 1] if depth else root
        best, common = None, 0
        for child, _ in self.tiers.children(parent, rest) if rest else ():
            shared = common_tokens(child.tokens, rest)
            if best is None or shared > common:
                best, common = child, shared
        return Nearest(keys, depth, reason, best, common)

    def shared(self, data: bytes, root: bytes) -> int:
        """Tokens of ``data`` that some stored sequence shares, restorable or not."""
        return self._shared(self._stand(data, root, ()))

    # -- the matched chain -------------------------------------------------------

    def _stand(self, data: bytes, root: bytes, exclude: Container[bytes]) -> _Standing:
        bs = self.config.block_size
        keys = chain_keys(root, data, bs)
        entries, tiers = self.tiers.chain(keys)
        depth, reason = walk(entries, root, data, bs)
        if exclude:
            depth = next((i for i in range(depth) if keys[i] in exclude), depth)
        if reason is None and depth < len(keys):
            reason = self.tiers.missing_reason(keys[depth])
        return _Standing(data, root, keys, entries[:depth], tiers[:depth], reason)

    def _children(self, stand: _Standing, level: int) -> list[tuple[ChainEntry, Tier]]:
        """What the tiers list under the chain's block ``level - 1`` (the root at 0)."""
        found = stand.children.get(level)
        if found is None:
            parent = stand.entries[level - 1].key if level else stand.root
            rest = stand.data[level * self.config.block_size * TOKEN_BYTES :]
            found = stand.children[level] = self.tiers.children(parent, rest)
        return found

    def _shared(self, stand: _Standing) -> int:
        depth = len(stand.entries)
        start = depth * self.config.block_size
        rest = stand.data[start * TOKEN_BYTES :]
        if not rest:  # the prompt ends on the chain: nothing to list (no LMDB read)
            return start
        common = (common_tokens(c.tokens, rest) for c, _ in self._children(stand, depth))
        return start + max(common, default=0)

    # -- restore points, deepest first -----------------------------------------

    def _points(self, stand: _Standing, limit: int, exclude: Container[bytes]):
        """Candidate restore points at most ``limit`` tokens long, deepest first."""
        bs = self.config.block_size
        for level in range(len(stand.entries), -1, -1):
            start = level * bs
            found = []
            rest = stand.data[start * TOKEN_BYTES :]
            skip = stand.keys[level] if level < len(stand.entries) else None  # the chain's own
            for child, tier in self._children(stand, level) if rest else ():
                if child.key == skip or child.key in exclude:
                    continue
                common = common_tokens(child.tokens, rest)
                end = min(start + common, limit)
                if end > start:
                    cut = (end - start) * TOKEN_BYTES < len(child.tokens)
                    found.append(_Point(end, level, child, tier, cut))
            found.sort(key=lambda p: (-p.num_tokens, p.cut, self._rank_of(p.tier)))
            yield from found
            if level:
                yield _Point(min(start, limit), level, cut=start > limit)

    def _why_not(
        self, stand: _Standing, point: _Point, names: dict[bytes, Container[str] | None]
    ) -> MissReason | None:
        """Why ``point`` cannot be restored from what the tiers hold, or None."""
        n = point.num_tokens
        if n <= 0:
            return MissReason.NO_PREFIX
        if point.cut and not self.layout.trimmable_at(n):
            return MissReason.PARTIAL_BLOCK  # recurrent state exists only where a block ends
        route = [*zip(stand.entries[: point.depth], stand.tiers[: point.depth], strict=True)]
        if point.child is not None:
            route.append((point.child, point.tier))

        def payload(index: int) -> Container[str] | None:
            entry, tier = route[index]
            if entry.key not in names:  # None: unknown, the load checks it
                names[entry.key] = tier.payload_names(entry.key)
            return names[entry.key]

        return self.layout.missing(n, payload)

    def _plan(
        self, stand: _Standing, point: _Point, shared: int, reason: MissReason | None
    ) -> Plan:
        entries = [*stand.entries[: point.depth]]
        tiers = [*stand.tiers[: point.depth]]
        if point.child is not None:
            entries.append(point.child)
            tiers.append(point.tier)
        return Plan(tuple(entries), tuple(tiers), point.num_tokens, shared, reason)

    def _rank_of(self, tier: Tier | None) -> int:
        return 0 if tier is None else self.tiers.all.index(tier)


def walk(
    entries: Sequence[ChainEntry], root: bytes, data: bytes, block_size: int
) -> tuple[int, MissReason | None]:
    """(how many of ``entries`` (held by the tiers, root-first) match the prompt
    ``data``, why the next one does not): parent links, positions and stored token
    ids are checked (a key collision shows as ``token_mismatch``)."""
    step = block_size * TOKEN_BYTES
    parent = root
    depth = len(entries)
    for i, entry in enumerate(entries):
        if entry.parent != parent or entry.index != i:
            depth = i
            break
        parent = entry.key
    # the tokens in one comparison (a join is cheaper than a slice per block)
    if b"".join([e.tokens for e in entries[:depth]]) != data[: depth * step]:
        depth = next(
            i for i, e in enumerate(entries) if e.tokens != data[i * step : (i + 1) * step]
        )
    return depth, None if depth == len(entries) else MissReason.TOKEN_MISMATCH
