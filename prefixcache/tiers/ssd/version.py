"""The SSD directory's format: its name and version, recorded in the index's
``meta`` database when the index is made and checked whenever it opens.

A directory of another format (or a newer version) is refused with
``SsdFormatError``, never read or changed.
"""

from __future__ import annotations

import lmdb

from ...errors import SsdFormatError

FORMAT_NAME = b"prefixcache-ssd"
FORMAT_VERSION = 1


def check_format(txn: lmdb.Transaction, meta_db: object, path: str, *, write: bool) -> bool:
    """True if the index records this format; a new index gets it recorded when
    ``write`` (else False); another format or version raises SsdFormatError."""
    name = txn.get(b"format", db=meta_db)
    version = txn.get(b"version", db=meta_db)
    if version is None:
        if write:
            txn.put(b"format", FORMAT_NAME, db=meta_db)
            txn.put(b"version", b"%d" % FORMAT_VERSION, db=meta_db)
        return write
    if name != FORMAT_NAME or version != b"%d" % FORMAT_VERSION:
        raise SsdFormatError(
            f"SSD tier {path} has format {name!r} version "
            f"{version.decode(errors='replace')}; this prefixcache reads "
            f"{FORMAT_NAME.decode()} version {FORMAT_VERSION}"
        )
    return True
