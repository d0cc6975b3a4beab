"""Partial blocks: where a prompt leaves the stored chain, the stored block it shares most with.

A prompt's full blocks are matched by chain key. Past the last match, the
children of the last matched block that any tier lists (full blocks of other
sequences, and tails: the last tokens of stored sequences) are compared with
the prompt token by token; the one sharing the most tokens can be restored
from its tier and cut back to them (``Lookup.partial_tokens`` says which
caches allow it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import MissReason
from .tiers.base import ChainEntry


@dataclass(frozen=True, slots=True)
class Match:
    """Where a prompt stands in the tiers.

    Attributes:
        keys: chain keys of the prompt's matched full blocks, then (when
            ``partial``) the partial block's key; past ``depth`` when not.
        owners: the tier (position in ``Tiers.all``) each key is loaded from.
        depth: full blocks matched, root-first.
        reason: why block ``depth`` did not match, if any.
        partial: the child of the last matched block (a full block the
            prompt diverges inside, or a tail) sharing the most tokens, in
            the tier ``owners[depth]``.
        common: tokens ``partial`` shares with the prompt.
    """

    keys: list[bytes]
    owners: list[int]
    depth: int
    reason: MissReason | None
    partial: ChainEntry | None
    common: int


def best_child(
    children: Sequence[tuple[ChainEntry, int]], index: int, rest: bytes
) -> tuple[ChainEntry | None, int, int]:
    """(child, its tier, tokens shared) of the (child, tier) at chain ``index``
    sharing the most leading tokens with ``rest``. Of equals, an upper tier's
    (faster to load), then the last listed (a later capture holds more payloads)."""
    best, owner, common = None, 0, 0
    for child, tier in children:
        if child.index != index:
            continue
        n = common_tokens(child.tokens, rest)
        if n and (n > common or (n == common and tier <= owner)):
            best, owner, common = child, tier, n
    return best, owner, common


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens (uint32 bytes) ``a`` and ``b`` share (bisection of slice compares)."""
    hi = min(len(a), len(b)) // 4
    if a[: hi * 4] == b[: hi * 4]:
        return hi
    lo = 0  # a[:lo] == b[:lo] and a[:hi] != b[:hi], in tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid
    return lo
