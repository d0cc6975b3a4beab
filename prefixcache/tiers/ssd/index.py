"""LMDB index of the SSD tier: entries, LRU of leaves, child links, in-flight writes.

Named databases of one environment (one per path per process; + records.py)::

    meta      format name and version, total payload bytes, corrupt-block count
    blocks    key -> encode_meta(BlockMeta)
    lru       big-endian last_used (us) + key -> b"" for every leaf (no indexed child)
    children  parent key -> child keys (dupsort) of every indexed block
    writing   key -> pid, thread id, file bytes of each payload being written

A write first reserves its bytes in ``writing`` (evicting LRU leaves so the
indexed plus reserved bytes stay under the cap and the disk keeps its free
headroom), then the payload is written, then :meth:`SsdIndex.finish_writes`
indexes it. Eviction unlinks payload files inside the transaction that drops
their entries. A crash leaves at most ``writing`` records of a dead pid, which
the next open or write clears: opening stays O(1).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import lmdb

from ...blocks import BlockMeta, decode_meta, encode_meta
from ...errors import SsdFormatError
from .lmdb_env import SharedEnv
from .payload import list_files, payload_path, temp_owner, temp_path, unlink
from .records import RECORD_DBS, pid_alive

logger = logging.getLogger(__name__)

FORMAT_NAME = b"prefixcache-ssd"
FORMAT_VERSION = 1
_U64 = struct.Struct("<Q")
_WRITING = struct.Struct("<IQQ")  # pid, native thread id, file bytes
Wanted = tuple[bytes, int, int]  # key, file bytes, disk footprint
_DBS = ("meta", "blocks", "lru", "children", "writing", *RECORD_DBS)
_DUPSORT = ("children",)


def _lru_key(meta: BlockMeta) -> bytes:
    return struct.pack(">Q", int(meta.last_used * 1e6)) + meta.key


def decode_or_none(key: bytes, raw: bytes | None) -> BlockMeta | None:
    """The decoded entry, or None if it is absent or unreadable."""
    if raw is None:
        return None
    try:
        return decode_meta(key, raw)
    except ValueError:
        return None


@dataclass(slots=True)
class Reservation:
    """Outcome of :meth:`SsdIndex.reserve`."""

    accepted: list[bytes] = field(default_factory=list)
    num_existing: int = 0  # already indexed or being written (maybe by another process)
    num_no_room: int = 0  # would not fit under the cap or the free-disk headroom
    num_evicted: int = 0


class SsdIndex:
    """The LMDB index of one SSD tier directory.

    Args:
        path: the LMDB directory.
        payloads: root of the payload files (unlinked here when entries drop).
        map_size: initial LMDB map size; doubled on MapFullError.
        readonly: open an existing index read-only: no write, no clean-up of dead writes.

    Raises:
        SsdFormatError: another format version wrote it (readonly: or it is incomplete).
    """

    def __init__(
        self, path: str, payloads: str, *, map_size: int = 1 << 36, readonly: bool = False
    ) -> None:
        if not readonly:
            os.makedirs(path, exist_ok=True)
        self.path = os.path.realpath(path)
        self._payloads = payloads
        try:
            self._shared = SharedEnv.acquire(
                self.path, map_size=map_size, dbs=_DBS, dupsort=_DUPSORT, readonly=readonly
            )
        except lmdb.NotFoundError as e:
            raise SsdFormatError(f"SSD tier index {self.path} lacks a database: {e}") from None
        self._db, self._txn = self._shared.dbs, self._shared.txn
        self._closed = False
        try:
            self._open_format(readonly)
            self.num_recovered = 0 if readonly else self._clear_dead_writes()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._shared.release()

    def get(self, key: bytes) -> bytes | None:
        return self._txn(lambda t: t.get(key, db=self._db["blocks"]))

    def totals(self) -> dict[str, int]:
        """num_blocks, nbytes (payload file bytes) and num_corrupt_total (all processes)."""

        def read(txn: lmdb.Transaction) -> dict[str, int]:
            return {
                "num_blocks": txn.stat(self._db["blocks"])["entries"],
                "nbytes": self._counter(txn, b"total_bytes"),
                "num_corrupt_total": self._counter(txn, b"num_corrupt"),
            }

        return self._txn(read)

    def scan(self, start: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (key, entry) pairs from ``start`` on, in key order."""

        def read(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            cur = txn.cursor(db=self._db["blocks"])
            if not cur.set_range(start):
                return []
            return [(bytes(k), bytes(v)) for k, v in itertools.islice(cur, limit)]

        return self._txn(read)

    def reserve(
        self, wanted: Sequence[Wanted], *, max_bytes: int, min_free_bytes: int,
        free_bytes: int,
    ) -> Reservation:  # fmt: skip
        """Reserve room for payloads (key, file bytes, disk footprint) about to be written.

        Evicts LRU leaves so that indexed + reserved file bytes stay <= ``max_bytes``
        and ``free_bytes`` (free disk now) minus the footprints stays >=
        ``min_free_bytes``. Keys that are indexed or being written already are skipped.
        """
        owner = (os.getpid(), threading.get_native_id())
        return self._txn(
            lambda t: self._reserve(t, wanted, owner, max_bytes, min_free_bytes, free_bytes),
            write=True,
        )

    def finish_writes(self, reserved: Sequence[bytes], written: Sequence[BlockMeta]) -> None:
        """Release reservations and index the payloads that were written."""

        def run(txn: lmdb.Transaction) -> None:
            for key in reserved:
                txn.delete(key, db=self._db["writing"])
            for meta in written:
                if txn.get(meta.key, db=self._db["blocks"]) is None:
                    self._insert(txn, meta)

        self._txn(run, write=True)

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Set last_used of indexed blocks to ``now`` (and move leaves in the LRU)."""

        def run(txn: lmdb.Transaction) -> None:
            for key in keys:
                meta = decode_or_none(key, txn.get(key, db=self._db["blocks"]))
                if meta is None:
                    continue
                new = dataclasses.replace(meta, last_used=now)
                txn.put(key, encode_meta(new), db=self._db["blocks"])
                if txn.delete(_lru_key(meta), db=self._db["lru"]):
                    txn.put(_lru_key(new), b"", db=self._db["lru"])

        self._txn(run, write=True)

    def quarantine(self, key: bytes, raw: bytes) -> bool:
        """Drop an entry found corrupt, unless it changed meanwhile (then: False)."""

        def run(txn: lmdb.Transaction) -> bool:
            if txn.get(key, db=self._db["blocks"]) != raw:
                return False  # evicted or rewritten by someone else: a race, not corruption
            self._drop_key(txn, key)
            self._add_counter(txn, b"num_corrupt", 1)
            return True

        return self._txn(run, write=True)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop entries and their payload files; returns how many were indexed."""
        return self._txn(lambda t: sum(self._drop_key(t, key) for key in keys), write=True)

    def evict_to(self, nbytes: int) -> int:
        """Evict LRU leaves until at most ``nbytes`` are indexed; returns blocks evicted."""
        return self._txn(lambda t: self._evict(t, lambda total, _: total <= nbytes)[0], write=True)

    def reconcile(self) -> tuple[int, int]:
        """Full scan: remove orphan payload/temp files and dangling or bad entries.

        Also rebuilds the LRU, the child links and the byte total from the entries.
        Returns (orphan files removed, dangling entries removed).
        """
        files, temps = list_files(self._payloads)
        self._clear_dead_writes()
        return self._txn(lambda t: self._reconcile(t, files, temps), write=True)

    # -- internals --------------------------------------------------------

    def _open_format(self, readonly: bool) -> None:
        def check(txn: lmdb.Transaction, write: bool) -> bool:
            name = txn.get(b"format", db=self._db["meta"])
            version = txn.get(b"version", db=self._db["meta"])
            if version is None:
                if write:
                    txn.put(b"format", FORMAT_NAME, db=self._db["meta"])
                    txn.put(b"version", b"%d" % FORMAT_VERSION, db=self._db["meta"])
                return write
            if name != FORMAT_NAME or version != b"%d" % FORMAT_VERSION:
                raise SsdFormatError(
                    f"SSD tier {self.path} has format {name!r} version "
                    f"{version.decode(errors='replace')}; this prefixcache reads "
                    f"{FORMAT_NAME.decode()} version {FORMAT_VERSION}"
                )
            return True

        if self._txn(lambda t: check(t, False)):
            return
        if readonly:
            raise SsdFormatError(f"SSD tier index {self.path} records no format version")
        self._txn(lambda t: check(t, True), write=True)

    def _clear_dead_writes(self) -> int:
        """Remove temp files and unindexed payloads of writers that died (O(#records))."""
        writing = self._db["writing"]
        records = self._txn(lambda t: [(bytes(k), bytes(v)) for k, v in t.cursor(db=writing)])
        dead = [(k, v) for k, v in records if not pid_alive(_WRITING.unpack(v)[0])]
        if dead:
            self._txn(lambda t: self._clear_writes(t, dead), write=True)
            logger.info("SSD tier: cleaned up %d writes of dead processes", len(dead))
        return len(dead)

    def _clear_writes(self, txn: lmdb.Transaction, records: list[tuple[bytes, bytes]]) -> None:
        for key, value in records:
            if txn.get(key, db=self._db["writing"]) != value:
                continue
            pid, tid, _ = _WRITING.unpack(value)
            final = payload_path(self._payloads, key)
            unlink(temp_path(final, pid, tid))
            if txn.get(key, db=self._db["blocks"]) is None:
                unlink(final)
            txn.delete(key, db=self._db["writing"])

    def _reserve(
        self, txn: lmdb.Transaction, wanted: Sequence[Wanted], owner: tuple[int, int],
        max_bytes: int, min_free: int, free: int,
    ) -> Reservation:  # fmt: skip
        res = Reservation()
        records = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._db["writing"])]
        dead = [(k, v) for k, v in records if not pid_alive(_WRITING.unpack(v)[0])]
        self._clear_writes(txn, dead)
        reserved = sum(_WRITING.unpack(v)[2] for _, v in txn.cursor(db=self._db["writing"]))
        for key, nbytes, footprint in wanted:
            busy = txn.get(key, db=self._db["writing"]) is not None
            if busy or txn.get(key, db=self._db["blocks"]) is not None:
                res.num_existing += 1
                continue
            budget = max_bytes - reserved - nbytes
            total = self._counter(txn, b"total_bytes")
            if budget < 0 or free + total < min_free + footprint:
                res.num_no_room += 1  # would not fit even with everything evicted
                continue
            need = min_free + footprint - free  # disk bytes to free
            num, freed = self._evict(txn, lambda tot, fr, b=budget, n=need: tot <= b and fr >= n)
            res.num_evicted += num
            free += freed
            if self._counter(txn, b"total_bytes") > budget or free < min_free + footprint:
                res.num_no_room += 1
                continue
            txn.put(key, _WRITING.pack(*owner, nbytes), db=self._db["writing"])
            reserved += nbytes
            free -= footprint
            res.accepted.append(key)
        return res

    # -- entries ------------------------------------------------------------

    def _insert(self, txn: lmdb.Transaction, meta: BlockMeta) -> None:
        txn.put(meta.key, encode_meta(meta), db=self._db["blocks"])
        txn.put(meta.parent, meta.key, db=self._db["children"])
        if not self._has_children(txn, meta.key):
            txn.put(_lru_key(meta), b"", db=self._db["lru"])
        parent = decode_or_none(meta.parent, txn.get(meta.parent, db=self._db["blocks"]))
        if parent is not None:
            txn.delete(_lru_key(parent), db=self._db["lru"])  # no longer a leaf
        self._add_counter(txn, b"total_bytes", meta.file_bytes)

    def _drop(self, txn: lmdb.Transaction, meta: BlockMeta) -> int:
        """Remove an entry and its file; its parent may become a leaf. Returns file bytes."""
        txn.delete(meta.key, db=self._db["blocks"])
        txn.delete(_lru_key(meta), db=self._db["lru"])
        txn.delete(meta.parent, meta.key, db=self._db["children"])
        parent = decode_or_none(meta.parent, txn.get(meta.parent, db=self._db["blocks"]))
        if parent is not None and not self._has_children(txn, meta.parent):
            txn.put(_lru_key(parent), b"", db=self._db["lru"])
        self._add_counter(txn, b"total_bytes", -meta.file_bytes)
        unlink(payload_path(self._payloads, meta.key))
        return meta.file_bytes

    def _drop_key(self, txn: lmdb.Transaction, key: bytes) -> int:
        raw = txn.get(key, db=self._db["blocks"])
        if raw is None:
            return 0
        meta = decode_or_none(key, raw)
        if meta is not None:
            self._drop(txn, meta)
        else:  # unreadable entry: its links are unknown, so rebuild them all (rare)
            txn.delete(key, db=self._db["blocks"])
            unlink(payload_path(self._payloads, key))
            self._rebuild(txn)
        return 1

    def _has_children(self, txn: lmdb.Transaction, key: bytes) -> bool:
        return txn.cursor(db=self._db["children"]).set_key(key)

    def _evict(self, txn: lmdb.Transaction, enough: Callable[[int, int], bool]) -> tuple[int, int]:
        """Evict the least recently used leaf until ``enough(total, freed)``."""
        total, freed, num = self._counter(txn, b"total_bytes"), 0, 0
        cur = txn.cursor(db=self._db["lru"])
        while not enough(total, freed) and cur.first():
            lru_key = bytes(cur.key())
            key = lru_key[8:]
            meta = decode_or_none(key, txn.get(key, db=self._db["blocks"]))
            if meta is None or _lru_key(meta) != lru_key or self._has_children(txn, key):
                cur.delete()  # stale record
                continue
            size = self._drop(txn, meta)
            total, freed, num = total - size, freed + size, num + 1
        return num, freed

    def _reconcile(
        self, txn: lmdb.Transaction, files: dict[bytes, str], temps: list[str]
    ) -> tuple[int, int]:
        writing = self._db["writing"]
        live = {bytes(k) for k, v in txn.cursor(db=writing) if pid_alive(_WRITING.unpack(v)[0])}
        dangling = 0
        for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._db["blocks"])]:
            path = payload_path(self._payloads, key)
            if decode_or_none(key, raw) is None or (key not in files and not os.path.exists(path)):
                txn.delete(key, db=self._db["blocks"])
                unlink(path)
                dangling += 1
        orphans = 0
        for key, path in files.items():
            if key not in live and txn.get(key, db=self._db["blocks"]) is None:
                unlink(path)
                orphans += 1
        for path in temps:
            if not pid_alive(temp_owner(path)):
                unlink(path)
                orphans += 1
        self._rebuild(txn)
        return orphans, dangling

    def _rebuild(self, txn: lmdb.Transaction) -> None:
        """Recompute LRU, child links and byte total from the entries (drops bad ones)."""
        txn.drop(self._db["lru"], delete=False)
        txn.drop(self._db["children"], delete=False)
        metas = []
        for key, raw in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._db["blocks"])]:
            meta = decode_or_none(key, raw)
            if meta is None:
                txn.delete(key, db=self._db["blocks"])
                unlink(payload_path(self._payloads, key))
            else:
                metas.append(meta)
        for meta in metas:
            txn.put(meta.parent, meta.key, db=self._db["children"])
        for meta in metas:
            if not self._has_children(txn, meta.key):
                txn.put(_lru_key(meta), b"", db=self._db["lru"])
        total = sum(m.file_bytes for m in metas)
        txn.put(b"total_bytes", _U64.pack(total), db=self._db["meta"])

    def _counter(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self._db["meta"])
        return _U64.unpack(raw)[0] if raw is not None else 0

    def _add_counter(self, txn: lmdb.Transaction, name: bytes, delta: int) -> None:
        value = max(0, self._counter(txn, name) + delta)
        txn.put(name, _U64.pack(value), db=self._db["meta"])
