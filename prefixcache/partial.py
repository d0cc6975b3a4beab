"""Partial blocks: where a prompt leaves the stored chain, the stored block it shares most with.

A prompt's full blocks are matched by chain key. Past the last match, the
children of the last matched block (full blocks of other sequences, and tails:
the last tokens of stored sequences) are compared with the prompt token by
token; the one sharing the most tokens can be restored and cut back to them
(see ``PrefixCache._partial_tokens`` for which caches allow it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import Block
from .errors import MissReason


@dataclass(frozen=True, slots=True)
class Match:
    """Where a prompt stands in the tiers.

    Attributes:
        keys: chain keys of the prompt's matched full blocks, then (when
            ``partial``) the partial block's key; past ``depth`` when not.
        owners: the tier (position in ``Tiers.all``) each key is loaded from.
        depth: full blocks matched, root-first.
        reason: why block ``depth`` did not match, if any.
        partial: the hot child of the last matched block (a full block the
            prompt diverges inside, or a tail) sharing the most tokens.
        common: tokens ``partial`` shares with the prompt.
    """

    keys: list[bytes]
    owners: list[int]
    depth: int
    reason: MissReason | None
    partial: Block | None
    common: int


def best_child(children: Sequence[Block], index: int, rest: bytes) -> tuple[Block | None, int]:
    """The child at chain ``index`` sharing the most leading tokens with ``rest``
    (of equals, the last stored: a later capture holds more payloads)."""
    best, common = None, 0
    for child in children:
        if child.index != index:
            continue
        n = common_tokens(child.tokens, rest)
        if n and n >= common:
            best, common = child, n
    return best, common


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
