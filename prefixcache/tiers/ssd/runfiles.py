"""Run files: consecutive blocks of one chain kept in ONE payload file of the SSD tier.

The writer groups the consecutive blocks of a chain that one batch holds (each
block's parent the previous one's key, one root and tenant, some tensor (B,
heads, tokens, dim) alike in all of them: plain and quantized K/V) into files
of up to ``ssd_run_tokens`` tokens (or ``ssd_run_growth`` times the tokens
before the run's first block, where that is more: ``run_length.py``). The file
is a normal payload (``payload.py``: checksum, per-tensor digests, atomic write) named by a key
derived from its blocks' keys; each K/V tensor (B, heads, tokens, dim) every
block has alike is its blocks' tensors one after another on the token axis, (B,
heads, k * block_size, dim), so a restore reads each (batch, head) row of a run
in one piece; any other tensor of a block (a recurrent layer's state snapshot
at a checkpoint, window K/V only some blocks keep) is an extra, kept whole for
that block after them, named ``"<name>@<block position>"``: blocks with and
without snapshots share a run. Its header's metadata names it a run:
``"run": "<block size>:<key hex>,<key hex>,..."``.

Each block keeps its own index entry (its file bytes and checksum: the run
file's) and gains a reference in the index's ``runs`` database (block key ->
file key, its position, the run's block count); ``runfiles`` holds, per run
file, its size, how many of its blocks are indexed, and its block keys. The
tier's and the tenant's bytes count a run file once, from its first block
indexed until its last one is dropped: only then is the file unlinked and its
bytes freed. Every function here runs inside the caller's write transaction.
"""

from __future__ import annotations

import dataclasses
import struct
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import lmdb
import xxhash

from ...blocks import BlockMeta
from ..run_length import RunHints, run_blocks
from ..writer import WriteItem
from .run_layout import EXTRA, joined

RUN_DBS = ("runs", "runfiles")
_REF = struct.Struct("<16sII")  # file key, position, block count
_FILE = struct.Struct("<QI")  # file bytes, indexed blocks; then the block keys
_KEY = 16


@dataclass(frozen=True, slots=True)
class RunRef:
    """Where a block's payload lies in a run file: block ``position`` of ``count``."""

    file_key: bytes
    position: int
    count: int


def file_key(keys: Sequence[bytes]) -> bytes:
    """The run file's key: a hash of its blocks' keys (never a block's own key)."""
    return xxhash.xxh3_128_digest(b"prefixcache-run\0" + b"".join(keys))


def metadata(block_size: int, keys: Sequence[bytes]) -> str:
    """The header's ``run`` field: block size and the blocks' keys in order."""
    return f"{block_size}:" + ",".join(k.hex() for k in keys)


# -- the writer's side ------------------------------------------------------------


def _spec(item: WriteItem, whole: tuple[str, ...] = ()) -> tuple[bytes, str, frozenset] | None:
    """(root, tenant, the block's tensors joined on the token axis), or None: it
    cannot be in a run (none on the token axis)."""
    n = item.block.num_tokens
    if not n or any(EXTRA in t.name for t in item.tensors):
        return None
    spec = frozenset(
        (t.name, t.dtype, t.shape) for t in item.tensors if joined(t.name, t.shape, n, whole)
    )
    return (item.block.root, item.block.tenant, spec) if spec else None


def _joins(spec: tuple | None, mine: tuple | None) -> tuple | None:
    """The run's spec with a block of spec ``mine`` added: the tensors on the token
    axis that every block has alike; None if none is left (the block starts another)."""
    if spec is None or mine is None or spec[:2] != mine[:2] or not spec[2] & mine[2]:
        return None
    return (*spec[:2], spec[2] & mine[2])


def group(
    items: Sequence[WriteItem],
    run_tokens: int,
    growth: float = 0.0,
    hints: Mapping[bytes, RunHints] | None = None,
) -> list[list[WriteItem]]:
    """``items`` cut into runs (lists of two blocks or more, in chain order, each
    at most ``run_blocks`` from its first block) and single blocks (lists
    of one), whatever order the batch holds them in. ``hints``: per root, the
    layers kept whole in its run files (``run_layout.joined``) and the blocks
    its widest longer window needs at a chain's end: where a run ends the
    chain's full blocks short of a whole run, those get a file of their own
    (``_split_end``)."""
    if run_tokens <= 0 or len(items) < 2:
        return [[it] for it in items]
    by_key = {it.block.key: it for it in items}
    kids: dict[bytes, list[WriteItem]] = {}
    for it in items:
        kids.setdefault(it.block.parent, []).append(it)
    heads = deque(it for it in items if it.block.parent not in by_key)
    out: list[list[WriteItem]] = []
    while heads:
        item: WriteItem | None = heads.popleft()
        current: list[WriteItem] = []
        spec = None
        most = 0  # blocks the current run may hold
        while item is not None:
            mine = _spec(item, hint.whole if (hint := _hint(hints, item)) else ())
            both = _joins(spec, mine)
            if both is None or len(current) >= most:
                ends = bool(current) and item.block.num_tokens != current[-1].block.num_tokens
                out.extend(_split_end(current, spec, most, hints) if ends else _cut(current))
                current, both = [], mine
                first = item.block
                most = run_blocks(first.index, first.num_tokens, run_tokens, growth)
            spec = both
            current.append(item)
            # the child of a full block's size goes on (a tail or a branch: their own)
            size = item.block.num_tokens
            below = sorted(kids.get(item.block.key, []), key=lambda c: c.block.num_tokens != size)
            heads.extend(below[1:])
            item = below[0] if below else None
        out.extend(_split_end(current, spec, most, hints))
    if sum(map(len, out)) != len(items):  # not a forest of chains: each block alone
        return [[it] for it in items]
    return out


def _cut(run: list[WriteItem]) -> list[list[WriteItem]]:
    """A run of two blocks or more as one file; one block as its own."""
    return [run] if len(run) > 1 else [[it] for it in run]


def _hint(hints: Mapping[bytes, RunHints] | None, item: WriteItem) -> RunHints | None:
    return hints.get(item.block.root) if hints else None


def _split_end(
    run: list[WriteItem], spec: tuple | None, most: int, hints: Mapping[bytes, RunHints] | None
) -> list[list[WriteItem]]:
    """A run that ends its chain's full blocks, cut as ``_cut`` does, its last blocks a
    window layer needs at that end in a file of their own where the run joins that
    layer's K/V on the token axis (``spec``: every block has it, as a cache prefilled
    in one chunk gives them): a restore of the whole chain uses those blocks' only,
    so it reads that file whole and of the one before only the full layers' K/V,
    which lead it (the window's are neither read nor hashed). Where only the last
    blocks keep window K/V (a cache that decoded since: its window rolled), they are
    extras read apart already, and the run stays whole; so it does where it is a
    whole run (``most`` blocks: where the writer's batch was cut, the chain goes on
    in the next). A batch the writer took where a store paused longer than its
    linger is cut so too: one more file inside the chain (gpt-oss-20b's shape at
    block 16: 10 files for 4,096 tokens, not 9)."""
    hint = _hint(hints, run[0]) if run and spec else None
    joins = hint is not None and any(name.startswith(hint.windows) for name, _, _ in spec[2])
    n = hint.window_blocks if joins else 0
    if 0 < 2 * n <= len(run) < most:  # no shorter a file before it than its own
        return _cut(run[:-n]) + _cut(run[-n:])
    return _cut(run)


# -- the index's side ------------------------------------------------------------


def has_runs(dbs: dict[str, object]) -> bool:
    """Whether this index keeps run files (an older one open read-only does not)."""
    return all(name in dbs for name in RUN_DBS)


def ref(txn: lmdb.Transaction, dbs: dict[str, object], key: bytes) -> RunRef | None:
    """Block ``key``'s run reference, or None: it has its own file."""
    if not has_runs(dbs):
        return None
    raw = txn.get(key, db=dbs["runs"])
    return None if raw is None else RunRef(*_REF.unpack(raw))


def refs(
    txn: lmdb.Transaction, dbs: dict[str, object], keys: Iterable[bytes]
) -> list[RunRef | None]:
    """``ref`` of each key, in one transaction."""
    if not has_runs(dbs):
        return [None for _ in keys]
    db, unpack = dbs["runs"], _REF.unpack
    raws = [txn.get(key, db=db) for key in keys]
    return [None if raw is None else RunRef(*unpack(raw)) for raw in raws]


def link(
    txn: lmdb.Transaction,
    dbs: dict[str, object],
    key: bytes,
    run: RunRef,
    file_bytes: int,
    keys: Sequence[bytes],
) -> int:
    """Index block ``key`` in its run file ``run`` (of ``keys``); the bytes to charge:
    the file's, for its first block indexed, else 0."""
    txn.put(key, _REF.pack(run.file_key, run.position, run.count), db=dbs["runs"])
    raw = txn.get(run.file_key, db=dbs["runfiles"])
    if raw is None:
        txn.put(run.file_key, _FILE.pack(file_bytes, 1) + b"".join(keys), db=dbs["runfiles"])
        return file_bytes
    size, live = _FILE.unpack_from(raw)
    txn.put(run.file_key, _FILE.pack(size, live + 1) + bytes(raw)[_FILE.size :], db=dbs["runfiles"])
    return 0


def unlink(txn: lmdb.Transaction, dbs: dict[str, object], key: bytes, run: RunRef) -> int:
    """Drop block ``key``'s reference; the file's bytes if it was the file's last
    block (the caller then removes the file), else 0."""
    txn.delete(key, db=dbs["runs"])
    raw = txn.get(run.file_key, db=dbs["runfiles"])
    if raw is None:
        return 0
    size, live = _FILE.unpack_from(raw)
    if live <= 1:
        txn.delete(run.file_key, db=dbs["runfiles"])
        return size
    txn.put(run.file_key, _FILE.pack(size, live - 1) + bytes(raw)[_FILE.size :], db=dbs["runfiles"])
    return 0


def file_record(
    txn: lmdb.Transaction, dbs: dict[str, object], key: bytes
) -> tuple[int, int, list[bytes]] | None:
    """(file bytes, indexed blocks, block keys) of run file ``key``, or None."""
    raw = txn.get(key, db=dbs["runfiles"]) if has_runs(dbs) else None
    if raw is None:
        return None
    raw = bytes(raw)
    size, live = _FILE.unpack_from(raw)
    rest = raw[_FILE.size :]
    return size, live, [rest[i : i + _KEY] for i in range(0, len(rest), _KEY)]


def siblings(txn: lmdb.Transaction, dbs: dict[str, object], key: bytes) -> list[bytes]:
    """``key`` and, if it lies in a run file, that file's other blocks still indexed
    there (a corrupt file fails them all)."""
    run = ref(txn, dbs, key)
    record = None if run is None else file_record(txn, dbs, run.file_key)
    if run is None or record is None:
        return [key]
    file = run.file_key
    same = [k for k in record[2] if k != key and (r := ref(txn, dbs, k)) and r.file_key == file]
    return [key, *same]


def recount(
    txn: lmdb.Transaction, dbs: dict[str, object], metas: Sequence[BlockMeta]
) -> tuple[list[BlockMeta], list[bytes]]:
    """After entries were dropped behind the links' back (a rebuild): references of
    blocks gone removed, each file's count of indexed blocks set again. Returns
    ``metas`` charged as the index charges them (a run file's bytes on one of its
    blocks, 0 on the others) and the run files left with no block (to unlink)."""
    if not has_runs(dbs):
        return list(metas), []
    live = {m.key for m in metas}
    counts: dict[bytes, int] = {}
    for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs["runs"])]:
        if key not in live:
            txn.delete(key, db=dbs["runs"])
            continue
        file = _REF.unpack(raw)[0]
        counts[file] = counts.get(file, 0) + 1
    dead = []
    for file, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs["runfiles"])]:
        size, _ = _FILE.unpack_from(raw)
        if not counts.get(file):
            txn.delete(file, db=dbs["runfiles"])
            dead.append(file)
        else:
            txn.put(file, _FILE.pack(size, counts[file]) + raw[_FILE.size :], db=dbs["runfiles"])
    charged, out = set(), []
    for meta, run in zip(metas, refs(txn, dbs, (m.key for m in metas)), strict=True):
        if run is not None and run.file_key in charged:
            meta = dataclasses.replace(meta, file_bytes=0)
        elif run is not None:
            charged.add(run.file_key)
        out.append(meta)
    return out, dead
