"""Each tenant's share of the SSD tier, kept in its index: bytes held, counters, leaves.

The hot tier keeps its tenants in memory (hot/tenants.py); the SSD tier is
shared by every process that opens its directory, so its tenants are kept in
the index and changed in the same write transaction (under the index's write
lock) that indexes or drops a block: the figures are those of every process,
and survive a restart. Two kinds of record::

    meta:       tenant/<name>    held file bytes, held blocks, and the counters:
                                 stored, evicted (of those, for its cap), removed,
                                 refused (little-endian u64 each)
                tenant_size/<~bytes held, big-endian u64><name>   every tenant
                                 holding any, the largest first (``over_floor``)
    tenant_lru: <u16 name length><name><lru key>   every unpinned leaf of the tenant

A block is charged to the tenant recorded in its index entry (``BlockMeta.tenant``;
the empty name, the default tenant, for entries written before tenants were
recorded). Every block indexed counts as stored, every block dropped as
evicted or removed: stored = held + evicted + removed, for each tenant.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import lmdb

from ...blocks import BlockMeta
from ..hot.tenants import COUNTERS

TENANT_DBS = ("tenant_lru",)
FIELDS = ("nbytes", "num_blocks", *COUNTERS)
_RECORD = struct.Struct("<" + "Q" * len(FIELDS))
_TENANT = b"tenant/"
_SIZE = b"tenant_size/"
_SIZES_KEPT = b"tenant_sizes"  # in meta once every tenant's size entry is there
_NAME_LENGTH = struct.Struct(">H")
_LARGEST = (1 << 64) - 1


def prefix(name: str) -> bytes:
    """The ``tenant_lru`` keys of tenant ``name`` start with this (length first: no
    name is a prefix of another's keys)."""
    raw = name.encode()
    return _NAME_LENGTH.pack(len(raw)) + raw


def lru_entry(meta: BlockMeta, lru: bytes) -> bytes:
    """``meta``'s key in ``tenant_lru``, given its key in ``lru``."""
    return prefix(meta.tenant) + lru


def figures(txn: lmdb.Transaction, db: object, name: str) -> dict[str, int]:
    """Tenant ``name``'s figures (zeros if it has none)."""
    raw = txn.get(_TENANT + name.encode(), db=db)
    values = _RECORD.unpack(raw) if raw is not None else (0,) * len(FIELDS)
    return dict(zip(FIELDS, values, strict=True))


def add(txn: lmdb.Transaction, db: object, name: str, delta: Mapping[str, int]) -> None:
    """Add ``delta`` (field -> amount) to tenant ``name``'s figures (none below 0)."""
    now = figures(txn, db, name)
    was = now["nbytes"]
    for name_of_field, amount in delta.items():
        now[name_of_field] = max(0, now[name_of_field] + amount)
    txn.put(_TENANT + name.encode(), _RECORD.pack(*now.values()), db=db)
    if now["nbytes"] != was:
        _sized(txn, db, name, was, now["nbytes"])


def _size_key(name: str, nbytes: int) -> bytes:
    return _SIZE + (_LARGEST - nbytes).to_bytes(8, "big") + name.encode()


def _sized(txn: lmdb.Transaction, db: object, name: str, was: int, nbytes: int) -> None:
    """Move ``name``'s entry in the tenants by size from ``was`` bytes to ``nbytes``."""
    if was:
        txn.delete(_size_key(name, was), db=db)
    if nbytes:
        txn.put(_size_key(name, nbytes), b"", db=db)


def keep_sizes(txn: lmdb.Transaction, db: object) -> None:
    """Write every tenant's size entry if the index has none yet (one written before
    they were kept: O(tenants), once; ``add`` keeps them after)."""
    if txn.get(_SIZES_KEPT, db=db) is not None:
        return
    stale = []
    cur = txn.cursor(db=db)
    if cur.set_range(_SIZE):
        for key in cur.iternext(values=False):
            if not bytes(key).startswith(_SIZE):
                break
            stale.append(bytes(key))
    for key in stale:
        txn.delete(key, db=db)
    for name, held in every(txn, db).items():
        _sized(txn, db, name, 0, held["nbytes"])
    txn.put(_SIZES_KEPT, b"1", db=db)


def _by_size(txn: lmdb.Transaction, db: object) -> Iterator[tuple[int, str]]:
    """(bytes held, name) of every tenant holding any, the largest first (ties by name)."""
    cur = txn.cursor(db=db)
    if not cur.set_range(_SIZE):
        return
    for key in cur.iternext(values=False):
        key = bytes(key)
        if not key.startswith(_SIZE):
            return
        at = len(_SIZE)
        nbytes = _LARGEST - int.from_bytes(key[at : at + 8], "big")
        yield nbytes, key[at + 8 :].decode(errors="replace")


def every(txn: lmdb.Transaction, db: object) -> dict[str, dict[str, int]]:
    """Every tenant's figures, by name."""
    out: dict[str, dict[str, int]] = {}
    cur = txn.cursor(db=db)
    if cur.set_range(_TENANT):
        for key, value in cur:
            if not bytes(key).startswith(_TENANT):
                break
            name = bytes(key)[len(_TENANT) :].decode(errors="replace")
            out[name] = dict(zip(FIELDS, _RECORD.unpack(value), strict=True))
    return out


def recount(txn: lmdb.Transaction, db: object, metas: Iterable[BlockMeta]) -> None:
    """Set every tenant's held bytes and blocks to those of ``metas`` (the index
    after a rebuild). A tenant that holds fewer blocks than its record said had
    them removed (e.g. entries ``gc`` found dangling); one that holds more had
    them stored (an index written before tenants were recorded): the counts
    still add up."""
    held: dict[str, list[int]] = {}
    for meta in metas:
        mine = held.setdefault(meta.tenant, [0, 0])
        mine[0] += meta.file_bytes
        mine[1] += 1
    for name in {*every(txn, db), *held}:
        nbytes, num = held.get(name, (0, 0))
        was = figures(txn, db, name)
        gone, came = max(0, was["num_blocks"] - num), max(0, num - was["num_blocks"])
        delta = {"nbytes": nbytes - was["nbytes"], "num_blocks": num - was["num_blocks"]}
        add(txn, db, name, delta | {"num_removed": gone, "num_stored": came})


@dataclass(frozen=True, slots=True)
class Limits:
    """This process's floors and caps of the SSD tier by tenant (file bytes;
    ``ssd_tenant_floors`` / ``ssd_tenant_caps``); every process applies its own."""

    floors: Mapping[str, int] = field(default_factory=dict)
    caps: Mapping[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.floors or self.caps)

    def over_floor(
        self, txn: lmdb.Transaction, db: object, pending: Mapping[str, int]
    ) -> Iterator[str]:
        """The tenants holding more than their floor, the most over first (ties by
        name), with the bytes ``pending`` (tenant -> bytes reserved, not indexed
        yet) counted. Lazy: the tenants with floors or pending bytes are read
        one by one, the others come from the tenants by size (the largest first:
        over a floor of 0 by all they hold); the first costs O((floors +
        pending) log tenants), each next one O(log tenants)."""
        named = {*self.floors, *pending}
        listed = []
        for name in named:
            above = figures(txn, db, name)["nbytes"] + pending.get(name, 0)
            above -= self.floors.get(name, 0)
            if above > 0:
                listed.append((-above, name))
        others = ((-n, name) for n, name in _by_size(txn, db) if name not in named)
        for _, name in heapq.merge(sorted(listed), others):
            yield name
