"""Where a token index of a chat prompt falls among the request's messages.

A chat template may render a message differently depending on what follows it
(reasoning stripped from earlier assistant turns, a system message moved), so
rendering the first k messages alone does not give the offsets the full prompt
has. Instead, message j's content is changed (a marker put at its end, which
a template that strips a leading part keeps) and the prompt rendered again:
the first token that differs from the full prompt is where message j's
content ends in it. Those ends grow with j, so a binary search finds the
message holding an index in about log2(messages) renders. A message's role
header counts as its own; the tokens that close it, as the next one's.

Rendering costs milliseconds a time on long chats, so where the tokenizer can
decode, the ends are found in the decoded prompt first: each message's content,
searched in order, or its last characters where the template changed it (one
that strips a leading part of a message keeps its end). Only when some content is empty or not
found so do the renders run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Render = Callable[[list[dict[str, Any]]], Sequence[int]]
Decode = Callable[[list[int]], str]
_MARK = " \u00a7"  # put at the end of a message's content to find where it ends
_TAILS = (32, 16, 8)  # characters of a content's end searched for in the decoded prompt


def renderer(
    tokenizer: Any,
    *,
    tools: Sequence[Any] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Render:
    """The prompt ``tokenizer``'s chat template makes of a list of messages (with
    the generation prompt, as a chat request is served)."""

    def render(messages: list[dict[str, Any]]) -> Sequence[int]:
        kwargs = dict(template_kwargs or {})
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
        )

    return render


def plain(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` with text content (lists of text parts joined, none
    as ""), as mlx-lm's server hands them to the template.

    Raises:
        TypeError: a message is not a mapping with a string ``role``.
    """
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TypeError(f"messages[{i}] is not a message with a string role: {message!r:.80}")
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
            copy["content"] = "".join(t for t in parts if isinstance(t, str))
        elif content is None:
            copy["content"] = ""
        out.append(copy)
    return out


def locate(
    messages: Sequence[Mapping[str, Any]],
    index: int,
    prompt: Sequence[int],
    render: Render,
    decode: Decode | None = None,
) -> tuple[int, str]:
    """(message number, role) of the message token ``index`` of ``prompt`` (what
    ``render`` makes of ``messages``) falls in; tokens after the last message's
    content (the generation prompt) count as the last message's. ``decode``: the
    tokenizer's, to find the ends in the decoded prompt before rendering.

    Raises:
        TypeError: a message is not a mapping with a string role.
        ValueError: ``messages`` is empty.
    """
    msgs = plain(messages)
    if not msgs:
        raise ValueError("messages is empty: there is no message to place a token in")
    full = list(prompt)
    found = _by_text(msgs, index, full, decode) if decode is not None else None
    if found is not None:
        return found, msgs[found]["role"]

    def end(j: int) -> int:
        changed = {**msgs[j], "content": str(msgs[j]["content"]) + _MARK}
        other = list(render([*msgs[:j], changed, *msgs[j + 1 :]]))
        pairs = enumerate(zip(full, other, strict=False))
        return next((i for i, (a, b) in pairs if a != b), min(len(full), len(other)))

    lo, hi = 0, len(msgs) - 1  # the first message whose content ends after index
    while lo < hi:
        mid = (lo + hi) // 2
        if end(mid) > index:
            hi = mid
        else:
            lo = mid + 1
    return lo, msgs[lo]["role"]


def _by_text(msgs: list[dict[str, Any]], index: int, full: list[int], decode: Decode) -> int | None:
    """The message of token ``index`` from the decoded prompt, or None (a content is
    empty or not found in order)."""
    text = decode(full)
    at = len(decode(full[:index]))
    pos = 0
    for j, message in enumerate(msgs):
        content = str(message["content"])
        if not content:
            return None
        for part in (content, *(content[-n:] for n in _TAILS if n < len(content))):
            found = text.find(part, pos)  # else its end: the template changed the rest
            if found >= 0:
                break
        else:
            return None
        pos = found + len(part)
        if pos > at:
            return j
    return len(msgs) - 1


def rerendered(messages: Sequence[Mapping[str, Any]], message: int) -> bool:
    """Whether a divergence in ``message`` is a template re-rendering an earlier turn:
    an assistant message with more messages after it."""
    return message < len(messages) - 1 and messages[message].get("role") == "assistant"
