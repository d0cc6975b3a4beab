"""Inventory of an SSD tier directory: its blocks grouped by namespace, chains and forks.

Read through an :class:`SsdView` while servers may hold the directory open:
LMDB gives every process consistent reads, and a scan runs in short
transactions. The inventory keeps each block's index
fields but not its token ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ....blocks import BlockMeta
from ..index import decode_or_none
from .view import SsdView

_SCAN_CHUNK = 1024


def scan(view: SsdView) -> Iterator[tuple[bytes, bytes, BlockMeta | None]]:
    """(key, raw entry, decoded meta or None if unreadable) of every indexed block."""
    for key, raw in view.index.rows(_SCAN_CHUNK):
        yield key, raw, decode_or_none(key, raw)


def end_token(index: int, num_tokens: int, parent_tokens: int | None) -> int:
    """Where a block of ``num_tokens`` at chain ``index`` ends in its sequence: blocks
    before it are full (``parent_tokens`` each, when its parent is known), and a
    tail (shorter than a block) starts where its parent ends."""
    return index * (num_tokens if parent_tokens is None else parent_tokens) + num_tokens


@dataclass(frozen=True, slots=True)
class Entry:
    """A block's index fields, without its token ids."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    num_tokens: int
    nbytes: int  # payload bytes of the arrays
    file_bytes: int  # bytes of the payload file on disk (a run file's: this block's share)
    created: float
    last_used: float

    @classmethod
    def of(cls, m: BlockMeta) -> Entry:
        return cls(
            m.key,
            m.parent,
            m.root,
            m.index,
            m.num_tokens,
            m.nbytes,
            m.file_bytes,
            m.created,
            m.last_used,
        )


def _share_run_files(view: SsdView, entries: dict[bytes, Entry]) -> None:
    """Charge each block of a run file its share of the file's bytes (the shares
    add up to the file's size), so sums over blocks are the files' bytes."""
    keys = list(entries)
    for key, (_, run) in zip(keys, view.index.get_runs(keys), strict=True):
        if run is not None:
            size = entries[key].file_bytes
            share = size // run.count + (size % run.count if run.position == 0 else 0)
            entries[key] = dataclasses.replace(entries[key], file_bytes=share)


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """A namespace as recorded beside the index (``model`` is None if unrecorded)."""

    root: bytes
    model: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    kv_quant: tuple[int, ...] | None = None
    num_layers: int = 0
    text: str | None = None  # the canonical JSON

    @classmethod
    def parse(cls, root: bytes, text: str | None) -> NamespaceInfo:
        try:
            doc = json.loads(text) if text else {}
        except ValueError:
            doc = {}
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
            return cls(root, text=text)
        extra = doc.get("extra") if isinstance(doc.get("extra"), dict) else {}
        kv = doc.get("kv_quant")
        return cls(
            root,
            doc["model"],
            tuple(sorted((str(k), str(v)) for k, v in extra.items())),
            tuple(kv) if isinstance(kv, list) else None,
            len(doc.get("layout") or ()),
            text,
        )

    @property
    def label(self) -> str:
        """The model id (with extra keys), or ``?`` + the root key's first hex digits."""
        if self.model is None:
            return f"?{self.root.hex()[:12]}"
        extra = ",".join(f"{k}={v}" for k, v in self.extra)
        return f"{self.model} [{extra}]" if extra else self.model

    def matches(self, model: str) -> bool:
        """``model`` is this namespace's model id, or a prefix (4+ hex) of its root key."""
        hexed = model.lower()
        return model == self.model or (len(hexed) >= 4 and self.root.hex().startswith(hexed))


@dataclass(slots=True)
class Segment:
    """A run of blocks with one child each; a fork ends it (``children``)."""

    keys: list[bytes]
    start_token: int
    end_token: int
    nbytes: int
    children: list[Segment] = field(default_factory=list)


@dataclass(slots=True)
class Inventory:
    """Every readable block of a tier, its namespaces and child links."""

    entries: dict[bytes, Entry]
    namespaces: dict[bytes, NamespaceInfo]
    bad: list[bytes] = field(default_factory=list)  # entries that do not decode
    children: dict[bytes, list[bytes]] = field(default_factory=dict)

    @classmethod
    def load(cls, view: SsdView) -> Inventory:
        entries: dict[bytes, Entry] = {}
        bad: list[bytes] = []
        for key, _, meta in scan(view):
            if meta is None:
                bad.append(key)
            else:
                entries[key] = Entry.of(meta)
        _share_run_files(view, entries)
        recorded = view.records.namespaces()
        roots = set(recorded) | {e.root for e in entries.values()}
        namespaces = {r: NamespaceInfo.parse(r, recorded.get(r)) for r in sorted(roots)}
        inv = cls(entries, namespaces, bad)
        for e in sorted(entries.values(), key=lambda e: (e.created, e.key)):
            inv.children.setdefault(e.parent, []).append(e.key)
        return inv

    def roots(self, model: str | None = None) -> list[bytes]:
        """Namespaces (all, or those ``model`` matches), by label."""
        found = [ns for ns in self.namespaces.values() if model is None or ns.matches(model)]
        return [ns.root for ns in sorted(found, key=lambda ns: (ns.label, ns.root))]

    def blocks(self, roots: Iterable[bytes]) -> list[Entry]:
        wanted = set(roots)
        return [e for e in self.entries.values() if e.root in wanted]

    def link_error(self, e: Entry) -> str | None:
        """Why ``e`` cannot be reached from its root through stored blocks, or None."""
        if e.parent == e.root:
            return None if e.index == 0 else f"block {e.index} hangs off the root"
        parent = self.entries.get(e.parent)
        if parent is None:
            return f"parent {e.parent.hex()} is not stored"
        if parent.root != e.root or parent.index + 1 != e.index:
            return f"parent {e.parent.hex()} is block {parent.index} of another chain"
        return None

    def broken(self, roots: Iterable[bytes] | None = None) -> dict[bytes, str]:
        """Blocks whose link to their parent is broken (the tops of detached subtrees)."""
        entries = self.entries.values() if roots is None else self.blocks(roots)
        return {e.key: why for e in entries if (why := self.link_error(e)) is not None}

    def descendants(self, keys: Iterable[bytes]) -> set[bytes]:
        """``keys`` and every stored block below them."""
        out: set[bytes] = set()
        todo = [k for k in keys if k in self.entries]
        while todo:
            key = todo.pop()
            if key not in out:
                out.add(key)
                todo += self.children.get(key, [])
        return out

    def chain(self, key: bytes) -> tuple[list[Entry], bytes | None]:
        """Stored blocks from the highest reachable ancestor down to ``key``.

        Returns (entries root-first, the missing parent key or None if complete).
        """
        out: list[Entry] = []
        seen: set[bytes] = set()
        e = self.entries.get(key)
        while e is not None and e.key not in seen:
            out.append(e)
            seen.add(e.key)
            if self.link_error(e) is not None:
                return out[::-1], e.parent
            if e.parent == e.root:
                return out[::-1], None
            e = self.entries.get(e.parent)
        return out[::-1], key if not out else out[-1].parent

    def leaves(self, roots: Iterable[bytes] | None = None) -> list[Entry]:
        entries = self.entries.values() if roots is None else self.blocks(roots)
        return [e for e in entries if not self.children.get(e.key)]

    def tree(self, root: bytes) -> tuple[list[Segment], list[Segment]]:
        """(segments hanging off ``root``, segments of detached subtrees)."""
        top = [k for k in self.children.get(root, []) if self.entries[k].root == root]
        detached = [k for k in self.broken([root]) if k not in top]
        return [self._grow(k, 0) for k in top], [self._grow(k, None) for k in detached]

    def _grow(self, key: bytes, start: int | None) -> Segment:
        """The subtree from ``key`` as segments (iterative: chains can be long)."""
        first = self.entries[key]
        if start is None:  # a detached block: assume the chain's blocks are equal-sized
            start = first.index * first.num_tokens
        top = self._segment(key, start)
        todo = [top]
        while todo:
            seg = todo.pop()
            for child in self.children.get(seg.keys[-1], []):
                sub = self._segment(child, seg.end_token)
                seg.children.append(sub)
                todo.append(sub)
        return top

    def _segment(self, key: bytes, start: int) -> Segment:
        e = self.entries[key]
        seg = Segment([key], start, start + e.num_tokens, e.file_bytes)
        while len(kids := self.children.get(seg.keys[-1], [])) == 1:
            e = self.entries[kids[0]]
            seg.keys.append(e.key)
            seg.end_token += e.num_tokens
            seg.nbytes += e.file_bytes
        return seg
