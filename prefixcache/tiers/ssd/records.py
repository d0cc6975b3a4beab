"""Records kept beside an SSD index: namespaces, persisted counters, the tier's limits.

One named database ``records`` of the index's LMDB environment::

    namespace/<root key>   the namespace's canonical JSON (``Namespace.to_json()``)
    counters/<root key>    JSON of summed ``Stats`` counters (with ``miss_reasons``)
    limits                 JSON {"max_bytes": ..., "min_free_bytes": ..., "write_budget": ...}
    process/<pid>          a process that caches here, from its PrefixCache's start to close

A PrefixCache writes the namespace record when it first uses a root key (once
per root per process) and adds its counters since the last save on ``flush()``
and ``close()``. Counters are kept per *base* namespace (model id, layout, KV
quantization; roots with extra keys roll up into it), summed over every process
that used the directory. ``limits`` is the last writer's cap, for ``prefixcache
stats``; ``process/`` records tell the CLI which other processes have the
directory open (those of dead processes are ignored). Failures to write a
record (e.g. disk full) are logged once and ignored: these records are for
operators, never needed to serve a block.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import lmdb

from ...stats import Counters, add_counters
from .lmdb_env import SharedEnv

logger = logging.getLogger(__name__)

RECORD_DBS = ("records",)
_NAMESPACE = b"namespace/"
_COUNTERS = b"counters/"
_LIMITS = b"limits"
_PROCESS = b"process/"


class SsdRecords:
    """The ``records`` database of an open SSD index (shares its environment).

    Args:
        index_path: the LMDB directory of an :class:`SsdIndex` that is open.
    """

    def __init__(self, index_path: str) -> None:
        self._shared = SharedEnv.share(index_path)
        if "records" not in self._shared.dbs:
            self._shared.release()
            raise ValueError(f"the index at {index_path} was opened without a records database")
        self._db = self._shared.dbs["records"]
        self._closed = False
        self._warned = False
        self._registered = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._registered:
                self._write(lambda t: t.delete(_process_key(os.getpid()), db=self._db))
            self._shared.release()

    # -- writers (a PrefixCache) -------------------------------------------------

    def note_namespace(self, root: bytes, namespace_json: str) -> None:
        """Record which namespace ``root`` is (written only if absent or different)."""
        self._put_if_changed(_NAMESPACE + root, namespace_json.encode())

    def note_limits(self, *, max_bytes: int, min_free_bytes: int, write_budget: int = 0) -> None:
        """Record the tier's cap, free-disk headroom and daily write budget (0: none),
        and this process until :meth:`close`.

        Called by a PrefixCache (a writer), not by the CLI.
        """
        doc = {
            "max_bytes": max_bytes,
            "min_free_bytes": min_free_bytes,
            "write_budget": write_budget,
        }
        self._put_if_changed(_LIMITS, json.dumps(doc, sort_keys=True).encode())
        if not self._registered:
            self._registered = True
            self._write(lambda t: t.put(_process_key(os.getpid()), b"", db=self._db))

    def add_counters(self, root: bytes, delta: Counters) -> None:
        """Add ``delta`` to the counters record of ``root`` (one write transaction)."""
        if not any(delta.values()):
            return

        def run(txn: lmdb.Transaction) -> None:
            raw = txn.get(_COUNTERS + root, db=self._db)
            total = add_counters(_loads(raw) or {}, delta)
            txn.put(_COUNTERS + root, json.dumps(total, sort_keys=True).encode(), db=self._db)

        self._write(run)

    def drop_counters(self, roots: list[bytes]) -> None:
        """Forget the counters of these namespaces (``prefixcache clear``)."""
        self._write(lambda t: [t.delete(_COUNTERS + root, db=self._db) for root in roots])

    # -- readers (the CLI) -------------------------------------------------------

    def namespaces(self) -> dict[bytes, str]:
        """Root key -> namespace JSON of every recorded namespace."""
        return {k: v.decode() for k, v in self._prefixed(_NAMESPACE).items()}

    def counters(self) -> dict[bytes, Counters]:
        """Root key -> summed counters of every namespace that saved some."""
        return {k: _loads(v) or {} for k, v in self._prefixed(_COUNTERS).items()}

    def limits(self) -> dict[str, int] | None:
        raw = self._shared.txn(lambda t: t.get(_LIMITS, db=self._db))
        doc = _loads(raw)
        return {k: v for k, v in doc.items() if isinstance(v, int)} if doc else None

    def other_pids(self) -> list[int]:
        """Other live processes whose PrefixCache has the directory open."""
        pids = [int.from_bytes(key, "big") for key in self._prefixed(_PROCESS)]
        return sorted(pid for pid in pids if pid != os.getpid() and pid_alive(pid))

    # -- internals ---------------------------------------------------------------

    def _prefixed(self, prefix: bytes) -> dict[bytes, bytes]:
        def read(txn: lmdb.Transaction) -> dict[bytes, bytes]:
            cur = txn.cursor(db=self._db)
            out: dict[bytes, bytes] = {}
            if cur.set_range(prefix):
                for key, value in cur:
                    if not bytes(key).startswith(prefix):
                        break
                    out[bytes(key)[len(prefix) :]] = bytes(value)
            return out

        return self._shared.txn(read)

    def _put_if_changed(self, key: bytes, value: bytes) -> None:
        if self._shared.txn(lambda t: t.get(key, db=self._db)) == value:
            return
        self._write(lambda t: t.put(key, value, db=self._db))

    def _write(self, fn: Callable[[lmdb.Transaction], object]) -> None:
        try:
            self._shared.txn(fn, write=True)
        except lmdb.Error as e:  # e.g. disk full: operators' records are not worth a failure
            log = logger.debug if self._warned else logger.warning
            self._warned = True
            log("SSD index %s: could not write a record: %s", self._shared.path, e)


def _process_key(pid: int) -> bytes:
    return _PROCESS + pid.to_bytes(4, "big")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts; 0 or less never does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _loads(raw: bytes | None) -> dict | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
