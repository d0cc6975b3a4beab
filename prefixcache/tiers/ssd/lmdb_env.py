"""One shared ``lmdb.Environment`` per path per process, short transactions, map growth.

LMDB forbids opening one environment twice in a process, so every opener of a
path shares one (reference counted). Transactions run through
:meth:`SharedEnv.txn`, which grows the map on ``MapFullError`` and adopts
another process's growth on ``MapResizedError``. Resizing requires that no
transaction of this process is open, which a small shared/exclusive gate ensures.
Write transactions take :class:`WriteLock` (threads and, through a file lock,
processes) for as long as the caller needs past the commit.
A read-only opener shares a writable environment already
open, or opens the path read-only: it then writes nothing to the data file and
may be shared by other readers only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, TypeVar

import lmdb

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Gate:
    """Shared for transactions, exclusive for a map resize."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def resize(self, env: lmdb.Environment, map_size: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._resizing = True
            self._cond.wait_for(lambda: self._active == 0)
            try:
                env.set_mapsize(map_size)  # 0 adopts the size another process set
            finally:
                self._resizing = False
                self._cond.notify_all()


class WriteLock:
    """A thread lock that, on a writable environment, also holds an exclusive ``flock``
    of ``write.lock`` beside it: a write transaction and the unlinks that follow its
    commit are one step for every process on the directory (SsdIndex.transact)."""

    def __init__(self, path: str, mode: int, readonly: bool) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # re-entries of the holding thread: the flock is taken once
        self._fd = None
        if not readonly:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
            self._fd = os.open(os.path.join(path, "write.lock"), flags, mode)

    def __enter__(self) -> WriteLock:
        self._lock.acquire()
        if self._depth == 0 and self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._lock.release()
                raise
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SharedEnv:
    """A reference-counted environment with its named databases."""

    _open: ClassVar[dict[str, SharedEnv]] = {}  # realpath -> env, process-wide
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        path: str,
        env: lmdb.Environment,
        dbs: dict[str, object],
        readonly: bool = False,
        mode: int = 0o600,
    ) -> None:
        self.path, self.env, self.dbs, self.readonly = path, env, dbs, readonly
        self._gate = _Gate()
        self._refs = 1
        # held from a write transaction's start to the end of what follows its
        # commit (the unlinks of dropped files): see SsdIndex.transact
        self.write_lock = WriteLock(path, mode, readonly)

    @classmethod
    def acquire(
        cls,
        path: str,
        *,
        map_size: int,
        dbs: Sequence[str],
        dupsort: Sequence[str] = (),
        readonly: bool = False,
        mode: int = 0o600,
        optional: Sequence[str] = (),
    ) -> SharedEnv:
        """Open (or share the already open) environment at ``path`` (files made ``mode``).
        ``optional``: those of ``dbs`` left out (read-only) if they do not exist.

        Raises:
            ValueError: a writable open of a path this process has open read-only.
            lmdb.NotFoundError: ``readonly`` and one of ``dbs`` does not exist.
        """
        with cls._lock:
            shared = cls._open.get(path)
            if shared is not None:
                if shared.readonly and not readonly:
                    raise ValueError(f"LMDB {path} is open read-only in this process")
                shared._refs += 1
                return shared
            env = lmdb.open(
                path,
                map_size=map_size,
                max_dbs=len(dbs) + 1,
                subdir=True,
                readonly=readonly,
                mode=mode,
            )
            try:
                env.reader_check()  # free reader slots of dead processes
                handles = _open_dbs(env, dbs, dupsort, readonly, optional)
                shared = cls(path, env, handles, readonly, mode)
            except BaseException:
                env.close()
                raise
            cls._open[path] = shared
            return shared

    @classmethod
    def share(cls, path: str) -> SharedEnv:
        """The environment this process has open at ``path`` (one more reference).

        Raises:
            ValueError: ``path`` is not open in this process.
        """
        with cls._lock:
            shared = cls._open.get(path)
            if shared is None:
                raise ValueError(f"LMDB {path} is not open in this process")
            shared._refs += 1
            return shared

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs == 0:
                del self._open[self.path]
                self.write_lock.close()
                self.env.close()

    def txn(self, fn: Callable[[lmdb.Transaction], T], *, write: bool = False) -> T:
        """Run ``fn`` in one short transaction; grow the map and retry when it is full.

        ``fn`` may run again after a MapFullError, so its side effects outside
        the transaction must be idempotent.
        """
        while True:
            try:
                with self._gate.shared(), self.env.begin(write=write) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                size = self.env.info()["map_size"] * 2
                logger.info("LMDB %s: growing the map to %d bytes", self.path, size)
                self._gate.resize(self.env, size)
            except lmdb.MapResizedError:
                self._gate.resize(self.env, 0)


def _open_dbs(
    env: lmdb.Environment,
    dbs: Sequence[str],
    dupsort: Sequence[str],
    readonly: bool,
    optional: Sequence[str],
) -> dict[str, object]:
    """Handles of ``dbs`` (made if missing unless ``readonly``; then an ``optional``
    one that is missing is left out)."""
    handles = {}
    for name in dbs:
        try:
            handles[name] = env.open_db(name.encode(), dupsort=name in dupsort, create=not readonly)
        except lmdb.NotFoundError:
            if name not in optional:
                raise
    return handles
