"""Index entries inside one LMDB transaction: insert, drop, LRU of leaves, child links.

The named databases of the SSD index are kept consistent here: every indexed
block has an entry in ``blocks`` and a link under its parent in ``children``
and in ``nearby`` (ordered by its tokens, nearby.py);
a block with no indexed child (a leaf) is also in ``lru``, keyed by its
last use, unless it is pinned (``pins``: key -> pin end, file bytes; a pin
record outlives its block, so a block stored again under a pinned key is
pinned), and in its tenant's ``tenant_lru`` (shares.py); ``meta`` holds the
total payload bytes and each tenant's figures. Dropping an entry marks its
payload file for removal; the index unlinks it once the transaction has
committed (``unlink_dropped``), so a crash or an abort never leaves an entry
whose file is gone, only an orphan file that ``gc`` removes.
"""

from __future__ import annotations

import functools
import struct
import threading
import time

import lmdb

from ...blocks import BlockMeta, decode_meta, encode_meta
from . import nearby, runfiles, shares
from .files import payload_path, unlink
from .runfiles import RunRef

_U64 = struct.Struct("<Q")
PIN = struct.Struct("<dQ")  # pin end (Unix time, inf: never), file bytes of the block


def lru_key(meta: BlockMeta) -> bytes:
    """The ``lru`` key of a leaf: big-endian last use (us), then the block key."""
    return struct.pack(">Q", int(meta.last_used * 1e6)) + meta.key


def decode_or_none(key: bytes, raw: bytes | None) -> BlockMeta | None:
    """The decoded entry, or None if it is absent or unreadable."""
    if raw is None:
        return None
    if type(raw) is bytes:  # a restore decodes each entry twice: lookup, then load
        return _decoded(key, raw)
    return _decode(key, raw)


@functools.lru_cache(maxsize=2048)
def _decoded(key: bytes, raw: bytes) -> BlockMeta | None:
    return _decode(key, raw)


def _decode(key: bytes, raw: bytes) -> BlockMeta | None:
    try:
        return decode_meta(key, raw)
    except ValueError:
        return None


class _Dropped(threading.local):
    """Payload files dropped by this thread's open write transaction."""

    def __init__(self) -> None:
        self.paths: list[str] = []


class Entries:
    """Entry operations on the index's databases, each within the caller's transaction.

    Args:
        dbs: the environment's named database handles.
        payloads: root of the payload files.
    """

    def __init__(self, dbs: dict[str, object], payloads: str) -> None:
        self.db = dbs
        self.payloads = payloads
        self._local = _Dropped()

    def unlink_dropped(self, committed: bool) -> None:
        """Remove the files of entries this thread's last write transaction dropped."""
        paths, self._local.paths = self._local.paths, []
        for path in paths if committed else ():
            unlink(path)

    def drop_file(self, key: bytes) -> None:
        """Remove payload file ``key`` once the open write transaction commits."""
        self._drop_file(key)

    def _drop_file(self, key: bytes) -> None:
        self._local.paths.append(payload_path(self.payloads, key))

    def meta(self, txn: lmdb.Transaction, key: bytes) -> BlockMeta | None:
        return decode_or_none(key, txn.get(key, db=self.db["blocks"]))

    def insert(
        self,
        txn: lmdb.Transaction,
        meta: BlockMeta,
        run: RunRef | None = None,
        run_keys: tuple[bytes, ...] = (),
    ) -> None:
        """Index ``meta``; ``run``: its place in a run file of blocks ``run_keys``
        (the file's bytes charged with its first block indexed: runfiles.py)."""
        txn.put(meta.key, encode_meta(meta), db=self.db["blocks"])
        self.link(txn, meta)
        if not self.has_children(txn, meta.key) and not self.pinned(txn, meta.key):
            self.lru_put(txn, meta)
        parent = self.meta(txn, meta.parent)
        if parent is not None:
            self.lru_delete(txn, parent)  # no longer a leaf
        charged = meta.file_bytes
        if run is not None:
            charged = runfiles.link(txn, self.db, meta.key, run, meta.file_bytes, run_keys)
        self.add_counter(txn, b"total_bytes", charged)
        charge = {"nbytes": charged, "num_blocks": 1, "num_stored": 1}
        shares.add(txn, self.db["meta"], meta.tenant, charge)

    def drop(
        self, txn: lmdb.Transaction, meta: BlockMeta, *, evicted: bool = False, cap: bool = False
    ) -> int:
        """Remove an entry and its file (a run file: with its last block indexed);
        its parent may become a leaf. Counted to its tenant as evicted (``cap``: for
        its tenant's cap), else removed. Returns the file bytes freed."""
        txn.delete(meta.key, db=self.db["blocks"])
        self.lru_delete(txn, meta)
        txn.delete(meta.parent, meta.key, db=self.db["children"])
        txn.delete(nearby.entry(meta.parent, meta.tokens, meta.key), db=self.db[nearby.DB])
        parent = self.meta(txn, meta.parent)
        if parent is not None and not self.leaf_pinned(txn, parent):
            self.lru_put(txn, parent)
        freed, file = meta.file_bytes, meta.key
        run = runfiles.ref(txn, self.db, meta.key)
        if run is not None:
            freed, file = runfiles.unlink(txn, self.db, meta.key, run), run.file_key
        self.add_counter(txn, b"total_bytes", -freed)
        why = {"num_evicted": 1, "num_cap_evictions": int(cap)} if evicted else {"num_removed": 1}
        release = {"nbytes": -freed, "num_blocks": -1}
        shares.add(txn, self.db["meta"], meta.tenant, release | why)
        if freed or run is None:
            self._drop_file(file)
        return freed

    def link(self, txn: lmdb.Transaction, meta: BlockMeta) -> None:
        """List ``meta`` under its parent: in ``children`` and in ``nearby``."""
        txn.put(meta.parent, meta.key, db=self.db["children"])
        txn.put(nearby.entry(meta.parent, meta.tokens, meta.key), meta.key, db=self.db[nearby.DB])

    def lru_put(self, txn: lmdb.Transaction, meta: BlockMeta) -> None:
        """Make ``meta`` a leaf in the LRU and in its tenant's."""
        lru = lru_key(meta)
        txn.put(lru, b"", db=self.db["lru"])
        txn.put(shares.lru_entry(meta, lru), b"", db=self.db["tenant_lru"])

    def lru_delete(self, txn: lmdb.Transaction, meta: BlockMeta) -> bool:
        """Take ``meta`` out of the LRU and its tenant's; whether it was in the LRU."""
        lru = lru_key(meta)
        txn.delete(shares.lru_entry(meta, lru), db=self.db["tenant_lru"])
        return txn.delete(lru, db=self.db["lru"])

    def drop_key(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Drop ``key``'s entry (even an unreadable one); how many entries went (0: none)."""
        raw = txn.get(key, db=self.db["blocks"])
        if raw is None:
            return 0
        meta = decode_or_none(key, raw)
        if meta is not None:
            self.drop(txn, meta)
            return 1
        # unreadable: its links are unknown, rebuild them all (rare; drops other bad ones)
        txn.delete(key, db=self.db["blocks"])
        self._drop_file(key)
        return 1 + self.rebuild(txn)

    def has_children(self, txn: lmdb.Transaction, key: bytes) -> bool:
        return txn.cursor(db=self.db["children"]).set_key(key)

    def pinned(self, txn: lmdb.Transaction, key: bytes) -> bool:
        """Whether ``key`` is pinned now (write transactions: an expired record goes)."""
        raw = txn.get(key, db=self.db["pins"])
        if raw is None:
            return False
        if PIN.unpack(raw)[0] > time.time():
            return True
        txn.delete(key, db=self.db["pins"])
        return False

    def leaf_pinned(self, txn: lmdb.Transaction, meta: BlockMeta) -> bool:
        """True unless ``meta`` is an unpinned leaf (one that belongs in the LRU)."""
        return self.has_children(txn, meta.key) or self.pinned(txn, meta.key)

    def rebuild(self, txn: lmdb.Transaction) -> int:
        """Recompute LRUs, child links, byte totals (the tenants' too); drops unreadable
        entries: how many."""
        txn.drop(self.db["lru"], delete=False)
        txn.drop(self.db["tenant_lru"], delete=False)
        txn.drop(self.db["children"], delete=False)
        txn.drop(self.db[nearby.DB], delete=False)
        metas, num_bad = [], 0
        for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self.db["blocks"])]:
            meta = decode_or_none(key, raw)
            if meta is None:
                txn.delete(key, db=self.db["blocks"])
                self._drop_file(key)
                num_bad += 1
            else:
                metas.append(meta)
        for meta in metas:
            self.link(txn, meta)
        for meta in metas:
            if not self.leaf_pinned(txn, meta):
                self.lru_put(txn, meta)
        charged, dead = runfiles.recount(txn, self.db, metas)
        for file in dead:
            self._drop_file(file)
        total = sum(m.file_bytes for m in charged)
        txn.put(b"total_bytes", _U64.pack(total), db=self.db["meta"])
        shares.recount(txn, self.db["meta"], charged)
        return num_bad

    def counter(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self.db["meta"])
        return _U64.unpack(raw)[0] if raw is not None else 0

    def add_counter(self, txn: lmdb.Transaction, name: bytes, delta: int) -> None:
        value = max(0, self.counter(txn, name) + delta)
        txn.put(name, _U64.pack(value), db=self.db["meta"])
