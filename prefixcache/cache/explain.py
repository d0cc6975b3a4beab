"""Explain: where a prompt left the nearest stored sequence, and why no more was restored.

From the tiers' metadata only (nothing is loaded): the lookup's plan (what a
fetch would restore, ``num_cached``) and the nearest stored sequence
(``Lookup.nearest``: the matched chain and the child under its end sharing
the most). Stored blocks keep their token ids in every tier, so the stored
side of a divergence is read from the child's own tokens; which tier lost
the prompt's next block, and why, from the stack's record of losses
(tiers/losses.py). A prompt stored under another namespace (a salt, an
adapter, another model or layout) is found by hashing its first block under
the other roots this cache knows (those used in this process and those the
SSD tier records). With chat messages and a tokenizer, the divergence is
placed in a message (messages.py); one inside an earlier assistant message is
a template that re-renders earlier turns (e.g. reasoning stripped).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any, Protocol

from ..errors import MissReason
from ..hashing import TOKEN_BYTES, chain_keys
from ..tiers.base import Persistent
from ..tiers.losses import EVICTED, REMOVED
from ..tiers.stack import TierStack
from .lookup import Lookup, Nearest
from .messages import Render, locate, rerendered

BEFORE = 6  # tokens of context shown before the divergence
AFTER = 10  # tokens shown after it, on each side


class Why(str, Enum):
    """Why a prompt was not restored further than it was."""

    CACHED = "cached"  # all but the last token (the model needs one to prefill)
    NEW = "new"  # nothing stored shares the prompt's first token
    ENDED = "ended"  # the nearest stored sequence ends here: the rest is new
    DIVERGED = "diverged"  # the nearest stored sequence goes on with other tokens
    EVICTED = "evicted"  # the prompt's next block was stored, then lost (``tier``, ``cause``)
    NOT_ADMITTED = "not_admitted"  # a tier refused the prompt's next block (``tier``)
    TIER_DOWN = "tier_down"  # the tier holding it did not answer (``tier``)
    NOT_WORTH_IT = "not_worth_it"  # fetching it was judged slower than prefilling it
    STATE_MISSING = "state_missing"  # a layer cannot resume here (recurrent state, window)
    DAMAGED = "damaged"  # a stored block is unusable (checksum, layout)
    OTHER_NAMESPACE = "other_namespace"  # stored under another salt, adapter, model or layout


_RESTORE_WHY = {
    MissReason.PARTIAL_BLOCK: Why.STATE_MISSING,
    MissReason.BOUNDARY_MISSING: Why.STATE_MISSING,
    MissReason.WINDOW_NOT_COVERED: Why.STATE_MISSING,
    MissReason.REMOTE_UNAVAILABLE: Why.TIER_DOWN,
    MissReason.REMOTE_GATE: Why.NOT_WORTH_IT,
    MissReason.CORRUPT: Why.DAMAGED,
    MissReason.LAYOUT_MISMATCH: Why.DAMAGED,
    MissReason.TOKEN_MISMATCH: Why.DAMAGED,
    MissReason.PENDING_WRITE: Why.NOT_ADMITTED,
    MissReason.EVICTED: Why.EVICTED,
}
_REMOTE = frozenset({MissReason.REMOTE_UNAVAILABLE, MissReason.REMOTE_GATE})


class Decoder(Protocol):
    """What explain needs of a tokenizer to show an excerpt as text."""

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where a prompt left the nearest stored sequence, and why no more was restored.

    Attributes:
        num_tokens: the prompt's tokens.
        num_cached: tokens a fetch restores now.
        divergence: the token index where the prompt leaves the nearest stored
            sequence (tokens some stored sequence shares with it).
        why: the reason (:class:`Why`).
        tier: the tier at fault (lost the block, refused it, did not answer), or None.
        cause: what the tier did (``evicted``, ``removed``, ``not admitted``, ...)
            or the miss reason of the restore, or None.
        namespace: for ``other_namespace``: what differs (e.g. ``extra``), else None.
        before: prompt tokens just before the divergence (shared by both sides).
        prompt_tokens: the prompt's tokens from the divergence on.
        stored_tokens: the stored sequence's tokens from the divergence on (empty
            where it ends, or where it is the prompt's own lost block).
        before_text, prompt_text, stored_text: the same decoded, when a tokenizer
            was given; else None.
        message: index of the chat message the divergence falls in, when the
            request had messages; ``role``: its role.
        rerendered: the divergence falls inside an earlier assistant message: the
            chat template renders earlier turns differently (e.g. reasoning stripped).
    """

    num_tokens: int
    num_cached: int
    divergence: int
    why: Why
    tier: str | None = None
    cause: str | None = None
    namespace: str | None = None
    before: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    stored_tokens: tuple[int, ...] = ()
    before_text: str | None = None
    prompt_text: str | None = None
    stored_text: str | None = None
    message: int | None = None
    role: str | None = None
    rerendered: bool = False

    def short(self) -> str:
        """One header line: ``cached=96; at=100; why=diverged; message=3; role=assistant``."""
        parts = [f"cached={self.num_cached}", f"at={self.divergence}", f"why={self.why.value}"]
        if self.tier is not None:
            parts.append(f"tier={self.tier}")
        if self.message is not None:
            parts += [f"message={self.message}", f"role={self.role}"]
        if self.rerendered:
            parts.append("rerendered")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``why`` as its value)."""
        out = asdict(self)
        out["why"] = self.why.value
        return out


def explain_prompt(
    lookup: Lookup,
    data: bytes,
    root: bytes,
    others: Mapping[bytes, str],
    *,
    tokenizer: Decoder | None = None,
) -> Explanation:
    """The explanation of the prompt ``data`` (uint32 bytes) under ``root``;
    ``others``: other roots this cache knows -> what each stands for (JSON), with
    ``root``'s own under ``root``."""
    tokens = memoryview(data).cast("I").tolist()
    plan = lookup.plan(data, root)
    near = lookup.nearest(data, root)
    bs = lookup.config.block_size
    limit = len(tokens) - 1
    start = near.depth * bs
    stored = _stored_after(lookup.tiers, near)
    found = _classify(lookup.tiers, plan.num_tokens, plan.shared, limit, plan.reason, near, start)
    why, at, tier, cause = found
    namespace = None
    if why in (Why.NEW, Why.ENDED, Why.DIVERGED):
        other = _other_namespace(lookup, data, root, others, plan.shared)
        if other is not None:
            why, at, tier, cause, namespace = Why.OTHER_NAMESPACE, 0, None, None, other
    if why is not Why.DIVERGED or at != start + near.common:
        stored = ()
    record = Explanation(
        len(tokens),
        plan.num_tokens,
        at,
        why,
        tier,
        cause,
        namespace,
        tuple(tokens[max(0, at - BEFORE) : at]),
        tuple(tokens[at : at + AFTER]),
        tuple(stored[:AFTER]),
    )
    return with_text(record, tokenizer) if tokenizer is not None else record


def _stored_after(tiers: TierStack, near: Nearest) -> list[int]:
    """The nearest stored sequence's tokens after the divergence (up to ``AFTER``,
    following its first child past the end of a block); [] where it ends there."""
    child = near.child
    if child is None or near.common >= len(child.tokens) // TOKEN_BYTES:
        return []
    out = memoryview(child.tokens).cast("I").tolist()[near.common :]
    while len(out) < AFTER and child is not None:
        under = tiers.children(child.key)
        child = under[0][0] if under else None
        if child is not None:
            out += memoryview(child.tokens).cast("I").tolist()
    return out[:AFTER]


def _classify(
    tiers: TierStack,
    num_cached: int,
    shared: int,
    limit: int,
    reason: MissReason | None,
    near: Nearest,
    start: int,
) -> tuple[Why, int, str | None, str | None]:
    """(why, where, the tier at fault, its cause) from the plan and the nearest
    sequence (``start``: where the prompt's matched chain ends)."""
    if num_cached >= limit:
        return Why.CACHED, num_cached, None, None
    if num_cached < min(shared, limit) and reason in _RESTORE_WHY:
        tier = "remote" if reason in _REMOTE else None
        return _RESTORE_WHY[reason], num_cached, tier, reason.value
    if near.reason in _REMOTE:  # the chain stops where the remote tier did not answer
        return _RESTORE_WHY[near.reason], max(start, num_cached), "remote", near.reason.value
    if near.depth < len(near.keys) and not tiers.contains(near.keys[near.depth]):
        loss = tiers.losses.of(near.keys[near.depth])
        if loss is not None:  # the prompt's next block was stored, then lost
            why = Why.EVICTED if loss.cause in (EVICTED, REMOVED) else Why.NOT_ADMITTED
            return why, max(start, num_cached), loss.tier, loss.cause
    if shared == 0:
        return Why.NEW, 0, None, None
    child = near.child
    if child is not None and near.common < len(child.tokens) // TOKEN_BYTES:
        return Why.DIVERGED, shared, None, None
    return Why.ENDED, shared, None, None


def recorded_namespaces(tiers: TierStack) -> dict[bytes, str]:
    """Root key -> namespace JSON of what the lower tiers recorded."""
    out: dict[bytes, str] = {}
    for tier in tiers.lower:
        if isinstance(tier, Persistent):
            out.update(tier.namespaces())
    return out


def _other_namespace(
    lookup: Lookup, data: bytes, root: bytes, others: Mapping[bytes, str], shared: int
) -> str | None:
    """What differs in the namespace of another root that shares more of the prompt
    than ``root`` does (the first block must be held under it), or None."""
    bs = lookup.config.block_size
    if len(data) < bs * TOKEN_BYTES:
        return None
    best, most = None, shared
    for other in others:
        if other == root:
            continue
        first = chain_keys(other, data[: bs * TOKEN_BYTES], bs)[0]
        if not lookup.tiers.contains(first):
            continue
        theirs = lookup.shared(data, other)
        if theirs > most:
            best, most = other, theirs
    if best is None:
        return None
    return _difference(others.get(root, "{}"), others[best])


def _difference(own: str, other: str) -> str:
    """``field: theirs (this prompt: ours)`` for each namespace field that differs."""
    mine, theirs = json.loads(own), json.loads(other)
    fields = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
    return "; ".join(
        f"{k}: {json.dumps(theirs.get(k))} (this prompt: {json.dumps(mine.get(k))})" for k in fields
    )


def with_text(record: Explanation, tokenizer: Decoder) -> Explanation:
    """``record`` with its excerpts decoded by ``tokenizer``."""

    def text(ids: tuple[int, ...]) -> str:
        return tokenizer.decode(list(ids))

    return replace(
        record,
        before_text=text(record.before),
        prompt_text=text(record.prompt_tokens),
        stored_text=text(record.stored_tokens),
    )


def in_messages(
    record: Explanation,
    prompt: Sequence[int],
    messages: Sequence[Mapping[str, Any]],
    render: Render,
) -> Explanation:
    """``record`` with the chat message its divergence falls in (``prompt``: what
    ``render`` makes of ``messages``). Re-rendered: the stored sequence goes on with
    other tokens there (not one that merely ends) inside an earlier assistant message."""
    message, role = locate(messages, record.divergence, prompt, render)
    again = record.why is Why.DIVERGED and rerendered(messages, message)
    return replace(record, message=message, role=role, rerendered=again)
