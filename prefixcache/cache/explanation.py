"""The explanation of a miss: a frozen record of where a prompt left the nearest stored
sequence and why (``PrefixCache.explain`` makes it: explain.py).

``short()`` is the one-line form ``prefixcache serve`` sends in its
``X-Prefixcache-Explain`` header; ``as_dict()`` the JSON of ``POST
/v1/cache/explain`` and ``prefixcache explain --json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any, Protocol


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
