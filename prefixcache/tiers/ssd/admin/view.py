"""An existing SSD tier directory opened for inspection or maintenance, without a writer.

:class:`SsdView` is what the ``prefixcache`` inspection commands open instead
of a full :class:`~prefixcache.tiers.ssd.tier.SsdTier`: the LMDB index and the
records beside it, and where payload files are. It starts no thread and never
creates a directory. Read-only (the default), the index is opened read-only,
so nothing in the directory is written (LMDB's lock file still records the
reader); servers may hold the directory open and write meanwhile, and every
read sees a consistent snapshot. ``writable=True`` opens the index for the
commands that remove blocks (``gc``, ``clear``, ``verify --quarantine``).
"""

from __future__ import annotations

import os

from ....errors import CacheDirError
from ..files import payload_path
from ..index import SsdIndex
from ..records import SsdRecords

__all__ = ["SsdView"]


class SsdView:
    """The index, records and payload paths of an existing SSD tier directory.

    Args:
        path: the SSD tier directory (``ssd_dir``).
        writable: open the index for writing (removals); still no thread.

    Raises:
        CacheDirError: no such directory, or no prefixcache index in it.
        SsdFormatError: the index has another format version.
    """

    def __init__(self, path: str, *, writable: bool = False) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(self.path):
            raise CacheDirError(f"no SSD tier directory at {self.path}")
        if not os.path.isfile(os.path.join(self.path, "index", "data.mdb")):
            raise CacheDirError(f"{self.path} is not a prefixcache SSD tier (no index/data.mdb)")
        self.writable = writable
        self._payloads = os.path.join(self.path, "blocks")
        index_dir = os.path.join(self.path, "index")
        self.index = SsdIndex(index_dir, self._payloads, readonly=not writable)
        try:
            self.records = SsdRecords(self.index.path)
        except BaseException:
            self.index.close()
            raise

    def payload_file(self, key: bytes) -> str:
        """Where ``key``'s payload file is (whether or not it exists): its run file's
        while the index says it lies in one."""
        run = self.index.get_runs([key])[0][1]
        return payload_path(self._payloads, key if run is None else run.file_key)

    def close(self) -> None:
        self.records.close()
        self.index.close()

    def __enter__(self) -> SsdView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
