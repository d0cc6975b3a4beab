"""``prefixcache explain``: where a prompt leaves what an SSD tier directory holds, and why.

The model directory is loaded as ``prefixcache pin`` loads it (its tokenizer,
the model id serve gives the same ``--model``) and a PrefixCache opened on the
directory; ``PrefixCache.explain`` answers from the tiers' metadata (nothing
is restored, nothing stored). The prompt is a text file (tokenized as a text
completion) or a chat request's JSON body (``{"messages": [...], "tools":
[...]}``, rendered by the model's chat template as serve renders it), then
the divergence is placed in a message too. A fresh process has lost nothing
yet: which tier lost a block is known to the process that served it
(``POST /v1/cache/explain`` on the server).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import (
    Command,
    Doc,
    UsageError,
    add_common,
    emit,
    open_view,
    printable,
    ssd_dir,
)
from .pin import PinSession, read_prompt

_WHY_TEXT = {
    "cached": "cached: all but the last token (the model prefills at least one)",
    "new": "nothing stored shares the prompt's first tokens",
    "ended": "the stored sequence ends there: the rest is new",
    "diverged": "the stored sequence goes on with other tokens",
    "evicted": "the prompt's next block was stored, then lost",
    "not_admitted": "the prompt's next block was not admitted",
    "tier_down": "the tier holding it did not answer",
    "not_worth_it": "fetching it was judged slower than prefilling it",
    "state_missing": "a layer's state is missing there (recurrent state, window)",
    "damaged": "a stored block there is unusable",
    "other_namespace": "stored under another namespace",
}


def add_explain_args(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument(
        "file", nargs="?", help="a text prompt, or a chat request's JSON body ('-': stdin)"
    )
    p.add_argument("--text", help="the prompt itself (instead of FILE)")
    p.add_argument(
        "--model", required=True, help="the model directory, spelt as `prefixcache serve --model`"
    )
    p.add_argument("--salt", help="the request's cache_salt (as serve's requests carry)")
    p.add_argument("--block-size", type=int, help="tokens per block (as the server's)")
    p.add_argument("--kv-bits", type=int, help="KV quantization bits (as the server's)")
    p.add_argument("--kv-group-size", type=int, help="KV quantization group size")


def run_explain(args: argparse.Namespace) -> int:
    with open_view(ssd_dir(args)):  # an SSD tier there already: explain creates none
        pass
    try:
        text, source = read_prompt(args, purpose="explain")
        request = chat_request(text, source)
        with PinSession(args) as session:
            doc = _explain(session, text, request, args.salt)
    except ValueError as err:
        raise UsageError(str(err)) from None
    emit(args, doc, lambda: explain_text(doc))
    return 0


def chat_request(text: str, source: str) -> dict[str, Any] | None:
    """The chat request ``text`` holds (a JSON object with ``messages``), or None
    for plain text.

    Raises:
        ValueError: JSON with no usable ``messages`` list.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{source}: a JSON prompt needs a non-empty 'messages' list")
    return doc


def _explain(session: PinSession, text: str, request: dict[str, Any] | None, salt: Any) -> Doc:
    tok = session.tokenizer
    extra = {"cache_salt": salt} if salt is not None else None
    if request is None:
        tokens = list(tok.encode(text))
        got = session.pc.explain(tokens, extra=extra, tokenizer=tok)
    else:
        messages, tools = request["messages"], request.get("tools") or None
        from ..cache.messages import plain, renderer

        tokens = list(renderer(tok, tools=tools)(plain(messages)))
        got = session.pc.explain(tokens, extra=extra, tokenizer=tok, messages=messages, tools=tools)
    return {"model": session.model_id, "ssd_dir": session.pc.config.ssd_path, **got.as_dict()}


def explain_text(doc: Doc) -> str:
    """The human form of an explanation document."""
    lines = [
        f"{doc['num_tokens']} tokens, {doc['num_cached']} restorable "
        f"({printable(doc['model'])} in {printable(doc['ssd_dir'])})",
        f"leaves the nearest stored sequence at token {doc['divergence']}: {doc['why']} "
        f"({_WHY_TEXT.get(doc['why'], doc['why'])})",
    ]
    if doc["tier"] is not None:
        lines.append(f"  tier: {doc['tier']} ({doc['cause']})")
    if doc["namespace"] is not None:
        lines.append(f"  namespace: {printable(doc['namespace'])}")
    if doc["message"] is not None:
        again = ": an earlier turn the chat template renders differently" * doc["rerendered"]
        lines.append(f"  in message {doc['message']} ({doc['role']}){again}")
    for side in ("before", "prompt", "stored"):
        shown = doc[f"{side}_text"]
        if shown:
            lines.append(f"  {side + ':':8} {printable(repr(shown))}")
    return "\n".join(lines)


COMMANDS = (
    Command(
        "explain",
        "where a prompt leaves the stored sequences, and why no more is restored",
        add_explain_args,
        run_explain,
    ),
)
