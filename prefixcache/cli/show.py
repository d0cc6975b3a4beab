"""``prefixcache show`` (one block and its chain) and ``prefixcache tree`` (forks)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

from ..blocks import BlockMeta
from ..tiers.ssd.admin.inventory import Inventory, NamespaceInfo, Segment, end_token
from ..tiers.ssd.admin.view import SsdView
from ..tiers.ssd.index import decode_or_none
from .common import Doc, UsageError, emit, model_roots, ssd_command
from .report import format_age, format_bytes, short, table, tree_lines

Decoder = Callable[[list[int]], str]


def add_show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="block key in hex (a unique prefix is enough)")
    p.add_argument("--tokenizer", help="tokenizer.json or model directory (offline)")
    p.add_argument("--full", action="store_true", help="also the whole prefix's token ids")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="only this model (or 4+ hex digits of a root key)")


def load_decoder(path: str) -> Decoder:
    """Token ids -> text with a local tokenizer; never downloads.

    ``path`` is a ``tokenizer.json`` (read with ``tokenizers``) or a model
    directory (its ``tokenizer.json`` if any, else ``transformers.AutoTokenizer``).
    """
    path = os.path.expanduser(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if os.path.isfile(file):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(file)
        return lambda ids: tok.decode(ids, skip_special_tokens=False)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no tokenizer at {path}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return lambda ids: auto.decode(ids)


# -- show ---------------------------------------------------------------------


def cmd_show(view: SsdView, args: argparse.Namespace) -> int:
    key = _resolve(view, args.key)
    decode = None
    if args.tokenizer:
        try:
            decode = load_decoder(args.tokenizer)
        except Exception as err:  # tokenizers raises bare Exception; transformers OSError, ...
            raise UsageError(f"--tokenizer {args.tokenizer!r}: cannot load it: {err}") from None
    chain = _chain(view, key)
    if not chain:
        raise UsageError(f"block {key.hex()} was removed meanwhile")
    ns = NamespaceInfo.parse(chain[-1].root, view.records.namespaces().get(chain[-1].root))
    doc = _show_doc(view, chain, ns, decode, full=args.full)
    emit(args, doc, lambda: _show_text(doc, ns))
    return 0


def _resolve(view: SsdView, text: str) -> bytes:
    """The one key whose hex starts with ``text``.

    Raises:
        UsageError: ``text`` is not hex, or no key or several keys start with it.
    """
    prefix = text.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise UsageError(f"{text!r} is not a block key: keys are hex digits (see `ls`)")
    start = bytes.fromhex(prefix + "0" * (len(prefix) % 2))
    keys = [k for k, _ in view.index.scan(start, 3) if k.hex().startswith(prefix)]
    if not keys:
        raise UsageError(f"no block matches {text!r}: no stored key starts with it (see `ls`)")
    if len(keys) > 1:
        shown = ", ".join(k.hex() for k in keys[:2]) + ", ..." * (len(keys) > 2)
        raise UsageError(f"several blocks match {text!r} ({shown}): give more digits")
    return keys[0]


def _chain(view: SsdView, key: bytes) -> list[BlockMeta]:
    """The block and its stored ancestors, root-first (stops at a missing parent)."""
    chain: list[BlockMeta] = []
    meta = decode_or_none(key, view.index.get(key))
    limit = meta.index + 1 if meta is not None else 0  # a chain has no loops
    while meta is not None and len(chain) < limit:
        chain.append(meta)
        if meta.parent == meta.root:
            break
        meta = decode_or_none(meta.parent, view.index.get(meta.parent))
    return chain[::-1]


def _ids(meta: BlockMeta) -> list[int]:
    return np.frombuffer(meta.tokens, dtype="<u4").tolist()


def _show_doc(
    view: SsdView, chain: list[BlockMeta], ns: NamespaceInfo, decode: Decoder | None, *, full: bool
) -> Doc:
    m = chain[-1]
    path = view.payload_file(m.key)
    complete = chain[0].parent == chain[0].root and chain[0].index == 0
    end = end_token(m.index, m.num_tokens, chain[-2].num_tokens if len(chain) > 1 else None)
    doc: Doc = {
        "key": m.key.hex(),
        "model": ns.model,
        "root": m.root.hex(),
        "namespace": json.loads(ns.text) if ns.model is not None else None,
        "index": m.index,
        "num_tokens": m.num_tokens,
        "prefix_tokens": end,
        "nbytes": m.file_bytes,
        "payload_nbytes": m.nbytes,
        "checksum": f"{m.checksum:016x}",
        "created": m.created,
        "last_used": m.last_used,
        "payload_path": path,
        "payload_exists": os.path.exists(path),
        "complete": complete,
        "missing_parent": None if complete else chain[0].parent.hex(),
        "chain": [
            {
                "key": c.key.hex(),
                "index": c.index,
                "num_tokens": c.num_tokens,
                "nbytes": c.file_bytes,
            }
            for c in chain
        ],
        "tokens": _ids(m),
        "text": decode(_ids(m)) if decode else None,
    }
    if full:
        prefix = [t for c in chain for t in _ids(c)]
        doc["prefix_token_ids"] = prefix
        doc["prefix_text"] = decode(prefix) if decode else None
    return doc


def _show_text(doc: Doc, ns: NamespaceInfo) -> str:
    now = time.time()
    lines = [
        f"block {doc['key']}",
        f"  model       {ns.label}  (root {doc['root']})",
        f"  position    block {doc['index']}, tokens "
        f"{doc['prefix_tokens'] - doc['num_tokens']}-{doc['prefix_tokens']}",
        f"  size        {format_bytes(doc['nbytes'])} on disk, "
        f"{format_bytes(doc['payload_nbytes'])} of arrays",
        f"  checksum    xxh3-64 {doc['checksum']}",
        f"  created     {format_age(now - doc['created'])} ago",
        f"  last used   {format_age(now - doc['last_used'])} ago",
        f"  payload     {doc['payload_path']}" + ("" if doc["payload_exists"] else "  (MISSING)"),
        "",
        f"chain ({len(doc['chain'])} blocks, root first)"
        + ("" if doc["complete"] else f": parent {doc['missing_parent']} is NOT stored"),
    ]
    rows = [
        [c["index"], c["key"], c["num_tokens"], format_bytes(c["nbytes"])] for c in doc["chain"]
    ]
    lines += [
        "  " + line for line in table(("block", "key", "tokens", "size"), rows, "rlrr").split("\n")
    ]
    lines += ["", f"token ids ({doc['num_tokens']}): {' '.join(map(str, doc['tokens']))}"]
    if doc["text"] is not None:
        lines.append(f"text: {doc['text']!r}")
    if "prefix_token_ids" in doc:
        lines.append(f"prefix token ids: {' '.join(map(str, doc['prefix_token_ids']))}")
        if doc["prefix_text"] is not None:
            lines.append(f"prefix text: {doc['prefix_text']!r}")
    return "\n".join(lines)


# -- tree ---------------------------------------------------------------------


def cmd_tree(view: SsdView, args: argparse.Namespace) -> int:
    inv = Inventory.load(view)
    namespaces = []
    for root in model_roots(inv, args.model):
        top, detached = inv.tree(root)
        blocks = inv.blocks([root])
        if not blocks:
            continue
        namespaces.append(
            {
                "root": root.hex(),
                "model": inv.namespaces[root].model,
                "label": inv.namespaces[root].label,
                "num_blocks": len(blocks),
                "num_tokens": sum(e.num_tokens for e in blocks),
                "nbytes": sum(e.file_bytes for e in blocks),
                "num_chains": len(inv.leaves([root])),
                "num_forks": sum(len(inv.children.get(e.key, ())) > 1 for e in blocks)
                + (len(top) > 1),
                "tree": [_node(s) for s in top],
                "detached": [_node(s) for s in detached],
            }
        )
    doc = {"ssd_dir": view.path, "namespaces": namespaces}
    emit(args, doc, lambda: _tree_text(doc, inv))
    return 0


def _node(seg: Segment) -> Doc:
    """A segment as JSON (recursive: depth is the number of nested forks)."""
    return {
        "first_key": seg.keys[0].hex(),
        "last_key": seg.keys[-1].hex(),
        "num_blocks": len(seg.keys),
        "start_token": seg.start_token,
        "end_token": seg.end_token,
        "nbytes": seg.nbytes,
        "children": [_node(c) for c in seg.children],
    }


def _tree_text(doc: Doc, inv: Inventory) -> str:
    if not doc["namespaces"]:
        return "(no blocks)"
    lines: list[str] = []
    for ns in doc["namespaces"]:
        root = bytes.fromhex(ns["root"])
        top, detached = inv.tree(root)
        chains = f"{ns['num_chains']} chain" + "s" * (ns["num_chains"] != 1)
        lines.append(
            f"{ns['label']}  root {short(root)}: {chains}, "
            f"{ns['num_blocks']} blocks, {ns['num_tokens']} tokens, {format_bytes(ns['nbytes'])}"
        )
        lines += tree_lines(top)
        if detached:
            lines.append("  detached (parent not stored):")
            lines += tree_lines(detached, "  ")
        lines.append("")
    return "\n".join(lines).rstrip()


COMMANDS = (
    ssd_command(
        "show", "one block: metadata, chain back to the root, tokens", cmd_show, add_show_args
    ),
    ssd_command(
        "tree",
        "chains of each namespace as a tree: shared prefixes, forks",
        cmd_tree,
        add_tree_args,
    ),
)
