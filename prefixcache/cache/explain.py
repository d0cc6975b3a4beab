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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import MissReason
from ..hashing import TOKEN_BYTES, Namespace, chain_keys
from ..tiers.base import Persistent
from ..tiers.losses import EVICTED, REMOVED, SESSION_ENDED
from ..tiers.stack import TierStack
from .explanation import Decoder, Explanation, Why, with_text
from .lookup import Lookup, Nearest
from .messages import Decode, Render, locate, renderer, rerendered

BEFORE = 6  # tokens of context shown before the divergence
AFTER = 10  # tokens shown after it, on each side

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
_GONE = frozenset({EVICTED, REMOVED, SESSION_ENDED})  # else: refused or not written


class Explainer:
    """Explains prompts for one PrefixCache (its ``explain``), from its lookup and
    the namespaces it knows: ``roots`` (its own map of extra keys -> root key)
    and those the lower tiers recorded."""

    def __init__(
        self, lookup: Lookup, namespace: Namespace, roots: Mapping[tuple[Any, ...], bytes]
    ) -> None:
        self.lookup, self.namespace, self.roots = lookup, namespace, roots

    def explain(
        self,
        data: bytes,
        root: bytes,
        last: tuple[bytes, bytes, int, int, MissReason | None] | None,
        tokenizer: Decoder | None,
    ) -> Explanation:
        """The prompt ``data`` under ``root`` (called under the cache's lock); ``last``:
        the last fetch (prompt, root, shared, restored, why), None once a store followed."""
        fetched = last[2:] if last is not None and last[:2] == (data, root) else None
        return explain_prompt(
            self.lookup, data, root, self.namespaces, fetched, tokenizer=tokenizer
        )

    def placed(
        self,
        record: Explanation,
        tokens: Sequence[int],
        messages: Sequence[Mapping[str, Any]] | None,
        tokenizer: Any,
        tools: Sequence[Any] | None,
    ) -> Explanation:
        """``record`` placed in ``messages`` (rendered by ``tokenizer``'s chat template
        with ``tools``) when there are messages and a tokenizer."""
        if not messages or tokenizer is None:
            return record
        render = renderer(tokenizer, tools=tools)
        return in_messages(record, list(tokens), messages, render, tokenizer.decode)

    def namespaces(self) -> dict[bytes, str]:
        """Root key -> namespace JSON of every root the lower tiers recorded or the
        cache used."""
        used = {
            root: self.namespace.with_extra(dict(items)).to_json()
            for items, root in self.roots.items()
        }
        return recorded_namespaces(self.lookup.tiers) | used


def explain_prompt(
    lookup: Lookup,
    data: bytes,
    root: bytes,
    namespaces: Callable[[], Mapping[bytes, str]],
    fetched: tuple[int, int, MissReason | None] | None = None,
    *,
    tokenizer: Decoder | None = None,
) -> Explanation:
    """The explanation of the prompt ``data`` (uint32 bytes) under ``root``.

    ``namespaces``: the roots this cache knows -> what each stands for (JSON),
    ``root``'s own among them (asked only when the prompt's first block is not
    held under ``root``). ``fetched``: (shared, restored, miss reason) of this
    prompt's fetch when nothing was stored since: what it found is explained,
    and its lookup is not done again.
    """
    tokens = memoryview(data).cast("I").tolist()
    if fetched is None:
        plan = lookup.plan(data, root)
        fetched = plan.shared, plan.num_tokens, plan.reason
    shared, num_cached, reason = fetched
    near = lookup.nearest(data, root, again=True)
    bs = lookup.config.block_size
    start = near.depth * bs
    found = _classify(lookup.tiers, num_cached, shared, len(tokens) - 1, reason, near, start)
    why, at, tier, cause = found
    namespace = None
    if why in (Why.NEW, Why.ENDED, Why.DIVERGED) and shared < bs:
        other = _other_namespace(lookup, data, root, namespaces(), shared)
        if other is not None:
            why, at, tier, cause, namespace = Why.OTHER_NAMESPACE, 0, None, None, other
    stored = _stored_after(lookup.tiers, near) if why is Why.DIVERGED else []
    record = Explanation(
        len(tokens),
        num_cached,
        at,
        why,
        tier,
        cause,
        namespace,
        tuple(tokens[max(0, at - BEFORE) : at]),
        tuple(tokens[at : at + AFTER]),
        tuple(stored),
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
            why = Why.EVICTED if loss.cause in _GONE else Why.NOT_ADMITTED
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


def in_messages(
    record: Explanation,
    prompt: Sequence[int],
    messages: Sequence[Mapping[str, Any]],
    render: Render,
    decode: Decode | None = None,
) -> Explanation:
    """``record`` with the chat message its divergence falls in (``prompt``: what
    ``render`` makes of ``messages``; ``decode``: the tokenizer's). Re-rendered: the
    stored sequence goes on with other tokens there (not one that merely ends)
    inside an earlier assistant message."""
    message, role = locate(messages, record.divergence, prompt, render, decode)
    again = record.why is Why.DIVERGED and rerendered(messages, message)
    return replace(record, message=message, role=role, rerendered=again)
