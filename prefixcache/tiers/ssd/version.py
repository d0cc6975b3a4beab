"""The SSD directory's format: its name and version, recorded in the index's
``meta`` database when the index is made and checked whenever it opens.

A directory of another format (or a newer version) is refused with
``SsdFormatError``, never read or changed; one of an older version this
prefixcache reads (``READABLE``) is read as it is and upgraded when opened to
write (index.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lmdb

from ...errors import SsdFormatError

logger = logging.getLogger(__name__)

FORMAT_NAME = b"prefixcache-ssd"
FORMAT_VERSION = 3
# Versions this prefixcache reads; an older one is upgraded when opened to write
# (index.py). 1: index entries without a tenant (read as the default tenant's).
# 2: no run files (every block its own file; 3 adds them: runfiles.py). An
# older prefixcache refuses version 3: it would take run blocks' files as lost.
READABLE = (1, 2, 3)


def recorded_version(txn: lmdb.Transaction, meta_db: object, path: str) -> int | None:
    """The format version the index records (None: none yet, a new index).

    Raises:
        SsdFormatError: another format, or a version this prefixcache does not read.
    """
    name = txn.get(b"format", db=meta_db)
    version = txn.get(b"version", db=meta_db)
    if version is None:
        return None
    readable = {b"%d" % v: v for v in READABLE}
    if name != FORMAT_NAME or version not in readable:
        raise SsdFormatError(
            f"SSD tier {path} has format {name!r} version "
            f"{version.decode(errors='replace')}; this prefixcache reads "
            f"{FORMAT_NAME.decode()} versions {', '.join(map(str, READABLE))}"
        )
    return readable[version]


def record_version(txn: lmdb.Transaction, meta_db: object) -> None:
    """Record this format and version (a new index, or one just upgraded)."""
    txn.put(b"format", FORMAT_NAME, db=meta_db)
    txn.put(b"version", b"%d" % FORMAT_VERSION, db=meta_db)


def upgrade(
    txn: lmdb.Transaction, meta_db: object, path: str, rebuild: Callable[[lmdb.Transaction], object]
) -> None:
    """Record this version in a new index, or upgrade one of an older version:
    ``rebuild`` (the index's links and totals, every tenant's figures: its
    entries, of no tenant, are the default tenant's), then record it. Nothing
    if another process did it first."""
    was = recorded_version(txn, meta_db, path)
    if was is not None and was < 2:  # version 2 to 3 adds databases only
        rebuild(txn)
        logger.info("SSD tier index %s: upgraded from version %d", path, was)
    if was != FORMAT_VERSION:
        record_version(txn, meta_db)
