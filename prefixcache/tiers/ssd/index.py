"""LMDB index of the SSD tier: one short transaction per verb.

Named databases of one environment (one per path per process)::

    meta      format name and version, total payload bytes, corrupt-block count
    blocks    key -> encode_meta(BlockMeta)
    lru       big-endian last_used (us) + key -> b"" for every leaf (no indexed child)
    children  parent key -> child keys (dupsort) of every indexed block
    nearby    parent key + order of its tokens + key -> key (nearby.py)
    writing   key -> pid, thread id, file bytes of each payload being written
    pins      key -> pin end, file bytes
    tenant_lru  each tenant's leaves, least recently used first (shares.py)
    runs      key -> its run file's key, position, block count (runfiles.py)
    runfiles  run file key -> file bytes, blocks indexed, block keys

A write reserves its bytes (:meth:`SsdIndex.reserve`: room made by evicting LRU
leaves, within the cap and the disk's free space), writes the payload, then
:meth:`SsdIndex.finish_writes` indexes it; every verb keeps the databases
consistent (``Entries``). Opening clears dead processes' ``writing`` records: O(1).
An index of an older format version (no tenant in its entries, no run files)
opens as it is read-only, and is upgraded once when opened to write (version.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import lmdb

from ...blocks import BlockMeta, encode_meta
from ...errors import SsdFormatError
from . import budget, nearby, pinning, runfiles, shares, space
from .entries import Entries, decode_or_none
from .files import DIR_MODE, FILE_MODE
from .lmdb_env import SharedEnv
from .records import RECORD_DBS
from .runfiles import RUN_DBS, RunRef
from .space import Reservation, Wanted
from .version import FORMAT_VERSION, recorded_version, upgrade

__all__ = ["Reservation", "SsdIndex", "Wanted", "decode_or_none"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DBS = (
    *("meta", "blocks", "lru", "children", nearby.DB, "writing", "pins"),
    *RECORD_DBS,
    *shares.TENANT_DBS,
    *RUN_DBS,
)
_OPTIONAL = (*shares.TENANT_DBS, nearby.DB, *RUN_DBS)  # read-only: absent from an older index
_DUPSORT = ("children",)


class SsdIndex:
    """The LMDB index of one SSD tier directory.

    Args:
        path: the LMDB directory (created 0700 if missing).
        payloads: root of the payload files (unlinked here when entries drop).
        map_size: initial LMDB map size; doubled on MapFullError.
        readonly: open an existing index read-only: no write, no clean-up of dead writes.

    Raises:
        SsdFormatError: another format version wrote it (readonly: or it is incomplete).
        lmdb.Error, OSError: the index cannot be opened (e.g. read-only).
    """

    def __init__(
        self, path: str, payloads: str, *, map_size: int = 1 << 36, readonly: bool = False
    ) -> None:
        if not readonly:
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        self.path = os.path.realpath(path)
        try:  # read-only, an index of the previous version has no tenant_lru (writes use it)
            self._shared = SharedEnv.acquire(
                self.path,
                map_size=map_size,
                dbs=_DBS,
                dupsort=_DUPSORT,
                readonly=readonly,
                mode=FILE_MODE,
                optional=_OPTIONAL,
            )
        except lmdb.NotFoundError as e:
            raise SsdFormatError(f"SSD tier index {self.path} lacks a database: {e}") from None
        self.entries = Entries(self._shared.dbs, payloads)
        self._db = self.entries.db
        self._closed = False
        try:
            self._open_format(readonly)
            self.num_recovered = 0 if readonly else self.clear_dead_writes()
        except BaseException:
            self.close()
            raise

    def transact(self, fn: Callable[[lmdb.Transaction], T], *, write: bool = False) -> T:
        """One transaction; a write's dropped files go after its commit, under the write
        lock (threads and processes): no write may land beside them (over the cap)."""
        if not write:
            return self._shared.txn(fn)
        with self._shared.write_lock:
            try:
                result = self._shared.txn(fn, write=True)
            except BaseException:
                self.entries.unlink_dropped(committed=False)
                raise
            self.entries.unlink_dropped(committed=True)
            return result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._shared.release()

    def get(self, key: bytes) -> bytes | None:
        return self.transact(lambda t: t.get(key, db=self._db["blocks"]))

    def get_many(self, keys: Sequence[bytes], *, until_absent: bool = False) -> list[bytes | None]:
        """The entries of ``keys`` in one read (``until_absent``: up to the first
        key not indexed, which is the last, as None)."""

        def read(txn: lmdb.Transaction) -> list[bytes | None]:
            out: list[bytes | None] = []
            for key in keys:
                out.append(txn.get(key, db=self._db["blocks"]))
                if until_absent and out[-1] is None:
                    break
            return out

        return self.transact(read)

    def get_runs(self, keys: Sequence[bytes]) -> list[tuple[bytes | None, RunRef | None]]:
        """(entry, run file reference or None) of each of ``keys``, in one read."""

        def read(txn: lmdb.Transaction) -> list[tuple[bytes | None, RunRef | None]]:
            raws = [txn.get(key, db=self._db["blocks"]) for key in keys]
            return list(zip(raws, runfiles.refs(txn, self._db, keys), strict=True))

        return self.transact(read)

    def run_file(self, file_key: bytes) -> tuple[int, int, list[bytes]] | None:
        """(file bytes, blocks indexed, block keys) of a run file, or None."""
        return self.transact(lambda t: runfiles.file_record(t, self._db, file_key))

    def children(self, parent: bytes) -> list[tuple[bytes, bytes]]:
        """(key, entry) of every block indexed under ``parent``, in one read."""

        def read(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            cur = txn.cursor(db=self._db["children"])
            if not cur.set_key(parent):
                return []
            keys = [bytes(k) for k in cur.iternext_dup()]
            rows = ((k, txn.get(k, db=self._db["blocks"])) for k in keys)
            return [(k, bytes(raw)) for k, raw in rows if raw is not None]

        return self.transact(read)

    def children_near(self, parent: bytes, near: bytes) -> list[tuple[bytes, bytes]] | None:
        """(key, entry) of the few blocks under ``parent`` whose tokens lie nearest
        to ``near`` (nearby.py), in one read; None if this index has no such order
        (an older one open read-only)."""
        if nearby.DB not in self._db:
            return None

        def read(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            keys = nearby.around(txn.cursor(db=self._db[nearby.DB]), parent, near)
            rows = ((k, txn.get(k, db=self._db["blocks"])) for k in dict.fromkeys(keys))
            return [(k, bytes(raw)) for k, raw in rows if raw is not None]

        return self.transact(read)

    def totals(self) -> dict[str, int]:
        """num_blocks, nbytes (payload file bytes) and num_corrupt_total (all processes)."""

        def read(txn: lmdb.Transaction) -> dict[str, int]:
            return {
                "num_blocks": txn.stat(self._db["blocks"])["entries"],
                "nbytes": self.entries.counter(txn, b"total_bytes"),
                "num_corrupt_total": self.entries.counter(txn, b"num_corrupt"),
            }

        return self.transact(read)

    def scan(self, start: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (key, entry) pairs from ``start`` on, in key order."""

        def read(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            cur = txn.cursor(db=self._db["blocks"])
            if not cur.set_range(start):
                return []
            return [(bytes(k), bytes(v)) for k, v in itertools.islice(cur, limit)]

        return self.transact(read)

    def rows(self, chunk: int = 1024) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, entry), in key order, read ``chunk`` at a time (short transactions)."""
        start = b""
        while True:
            rows = self.scan(start, chunk)
            yield from rows
            if len(rows) < chunk:
                return
            start = rows[-1][0] + b"\0"

    def reserve(
        self,
        wanted: Sequence[Wanted],
        *,
        max_bytes: int,
        min_free_bytes: int,
        free_bytes: int,
        limits: shares.Limits | None = None,
    ) -> Reservation:
        """Reserve room for payloads (key, file bytes, disk footprint, tenant, blocks
        in it) about to be written.

        Evicts leaves so that indexed + reserved file bytes stay <= ``max_bytes``
        and ``free_bytes`` (free disk now) minus the footprints stays >=
        ``min_free_bytes``; ``limits``: the tenants' floors and caps (space.py).
        Keys that are indexed or being written already are skipped.
        """
        owner = (os.getpid(), threading.get_native_id())
        return self.transact(
            lambda t: space.reserve(
                t, self.entries, wanted, owner, max_bytes, min_free_bytes, free_bytes, limits
            ),
            write=True,
        )

    def tenants(self) -> dict[str, dict[str, int]]:
        """Every tenant's figures on this tier, all processes (shares.py)."""
        return self.transact(lambda t: shares.every(t, self._db["meta"]))

    def count_refused(self, by_tenant: Mapping[str, int]) -> None:
        """Add these refusals (tenant -> blocks) to the tenants' ``num_refused``."""

        def run(txn: lmdb.Transaction) -> None:
            for name, num in by_tenant.items():
                shares.add(txn, self._db["meta"], name, {"num_refused": num})

        self.transact(run, write=True)

    def finish_writes(
        self,
        reserved: Sequence[bytes],
        written: Sequence[BlockMeta],
        *,
        write_budget: int = 0,
        runs: Mapping[bytes, tuple[RunRef, tuple[bytes, ...]]] | None = None,
    ) -> None:
        """Release reservations, index the payloads that were written, charge their
        bytes to today's total and the write budget's bucket (budget.py). ``runs``:
        block key -> its run file reference and the file's block keys (a run file
        none of whose blocks was indexed here is removed)."""
        runs = runs or {}

        def run(txn: lmdb.Transaction) -> None:
            for key in reserved:
                txn.delete(key, db=self._db["writing"])
            files = {ref.file_key: False for ref, _ in runs.values()}
            for meta in written:
                if txn.get(meta.key, db=self._db["blocks"]) is None:
                    ref, keys = runs.get(meta.key, (None, ()))
                    self.entries.insert(txn, meta, ref, keys)
                    if ref is not None:
                        files[ref.file_key] = True
            for file, used in files.items():
                if not used:  # every block indexed meanwhile (another process)
                    self.entries.drop_file(file)
            # a run file's bytes once, whichever of its blocks were written
            sizes = {
                runs[m.key][0].file_key if m.key in runs else m.key: m.file_bytes for m in written
            }
            nbytes = sum(sizes.values())
            budget.charge(txn, self._db["records"], nbytes, write_budget, time.time())

        self.transact(run, write=True)

    def written(self, write_budget: int) -> tuple[float, int]:
        """(bytes in the write budget's bucket now, bytes written today, UTC)."""
        now = time.time()
        db = self._db["records"]
        return self.transact(
            lambda t: (budget.level(t, db, write_budget, now), budget.written_today(t, db, now))
        )

    def pin(self, items: Sequence[tuple[bytes, int]], until: float) -> None:
        """Pin (key, file bytes) items until ``until`` (pinning.py)."""
        self.transact(lambda t: pinning.pin(t, self.entries, items, until), write=True)

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self.transact(lambda t: pinning.unpin(t, self.entries, keys), write=True)

    def pins(self) -> dict[bytes, tuple[float, int]]:
        """Pins in force: key -> (end, file bytes)."""
        return self.transact(lambda t: pinning.records(t, self.entries))

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Set last_used of indexed blocks to ``now`` (and move leaves in the LRU)."""

        def run(txn: lmdb.Transaction) -> None:
            for key in keys:
                meta = self.entries.meta(txn, key)
                if meta is None:
                    continue
                new = dataclasses.replace(meta, last_used=now)
                txn.put(key, encode_meta(new), db=self._db["blocks"])
                if self.entries.lru_delete(txn, meta):
                    self.entries.lru_put(txn, new)

        self.transact(run, write=True)

    def probe(self) -> None:
        """One small write transaction: raises if the index cannot be written now."""
        self.transact(lambda t: t.put(b"probe", os.urandom(8), db=self._db["meta"]), write=True)

    def quarantine(self, key: bytes, raw: bytes, dropped: list[bytes] | None = None) -> int:
        """Drop an entry found corrupt unless it changed meanwhile, with every other
        block of its run file; how many bad ones went (0: it changed; an unreadable
        one's rebuild drops every other unreadable one). The keys of the blocks
        dropped are appended to ``dropped``."""

        def run(txn: lmdb.Transaction) -> int:
            if txn.get(key, db=self._db["blocks"]) != raw:
                return 0  # evicted or rewritten by someone else: a race, not corruption
            keys = runfiles.siblings(txn, self._db, key)
            num = sum(self.entries.drop_key(txn, k) for k in keys)
            self.entries.add_counter(txn, b"num_corrupt", num)
            if dropped is not None:
                dropped.extend(keys)
            return num

        return self.transact(run, write=True)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop entries and their payload files; returns how many were indexed."""
        return len(self.remove_keys(keys))

    def remove_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop entries and their payload files; returns the keys that were indexed."""
        return self.transact(lambda t: [k for k in keys if self.entries.drop_key(t, k)], write=True)

    def evict_to(self, nbytes: int, limits: shares.Limits | None = None) -> list[bytes]:
        """Evict leaves until at most ``nbytes`` are indexed (``limits``: the tenants'
        floors, space.py); returns their keys."""
        pick = space.tenant_leaf(limits) if limits else None

        def run(txn: lmdb.Transaction) -> list[bytes]:
            evicted: list[bytes] = []
            pinning.expire(txn, self.entries)
            space.evict(txn, self.entries, lambda total, _: total <= nbytes, evicted, pick)
            return evicted

        return self.transact(run, write=True)

    # -- internals --------------------------------------------------------

    def _open_format(self, readonly: bool) -> None:
        """Record the format in a new index, upgrade an index of an older version when
        opened to write, or refuse another format (version.py)."""
        meta = self._db["meta"]
        version = self.transact(lambda t: recorded_version(t, meta, self.path))
        self.format_version = version or FORMAT_VERSION  # what it is once open
        if version == FORMAT_VERSION:
            if not readonly:  # an index written before ``nearby`` existed gets it once
                self.transact(self._complete_nearby, write=True)
                self.transact(lambda t: shares.keep_sizes(t, meta), write=True)
            return
        if readonly:
            if version is None:
                raise SsdFormatError(f"SSD tier index {self.path} records no format version")
            return  # an older version reads as it is: its entries' tenant is the default
        self.format_version = FORMAT_VERSION
        self.transact(lambda t: upgrade(t, meta, self.path, self.entries.rebuild), write=True)
        self.transact(lambda t: shares.keep_sizes(t, meta), write=True)

    def _complete_nearby(self, txn: lmdb.Transaction) -> None:
        if not nearby.complete(txn, self._db["blocks"], self._db[nearby.DB]):
            self.entries.rebuild(txn)
            logger.info("SSD tier index %s: rebuilt its children's order", self.path)

    def clear_dead_writes(self) -> int:
        """Remove temp files and unindexed payloads of writers that died (O(#records))."""
        dead = space.dead(self.transact(lambda t: space.writing_records(t, self.entries)))
        if dead:
            self.transact(lambda t: space.clear_writes(t, self.entries, dead), write=True)
            logger.info("SSD tier: cleaned up %d writes of dead processes", len(dead))
        return len(dead)
