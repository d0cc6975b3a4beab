"""The SSD tier's directory: created owner-only, checked before a server listens.

``open_dir`` makes (or checks) ``DIR``, ``DIR/blocks`` and ``DIR/index`` as
real directories, created 0700: the blocks hold a model's prompts. Neither
subdirectory may be a symlink (payload paths never leave the directory).
``check_dir`` also writes a probe file in each and a transaction in the
index: what ``prefixcache serve`` runs before it listens, so a directory it
cannot use is a clear error at start instead of a failure at the first request.
"""

from __future__ import annotations

import os
import stat
import threading

import lmdb

from ...errors import SsdDirError
from .files import DIR_MODE, create_temp, parent_fd
from .index import SsdIndex

SUBDIRS = ("blocks", "index")


def open_dir(path: str) -> str:
    """Create or check the tier directory and its subdirectories; returns ``path/blocks``.

    Raises:
        SsdDirError: a part cannot be created, is not a directory, or is a symlink.
    """
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except FileExistsError:
        raise SsdDirError(path, "it exists and is not a directory") from None
    except OSError as e:
        raise SsdDirError(path, _why(e)) from None
    if not os.path.isdir(path):
        raise SsdDirError(path, "it exists and is not a directory")
    for name in SUBDIRS:
        sub = os.path.join(path, name)
        try:
            os.mkdir(sub, DIR_MODE)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(sub).st_mode):
                raise SsdDirError(path, f"{sub} is a symlink or not a directory") from None
        except OSError as e:
            raise SsdDirError(path, f"cannot create {sub}: {_why(e)}") from None
    return os.path.join(path, "blocks")


def check_dir(path: str) -> None:
    """``open_dir``, then prove the directory writable: a probe file in it and in each
    subdirectory, and a write transaction in the index.

    Raises:
        SsdDirError: the directory cannot be used (the reason is in the message).
        SsdFormatError: it holds an index of another format version.
    """
    payloads = open_dir(path)
    for sub in (path, *(os.path.join(path, name) for name in SUBDIRS)):
        try:
            with parent_fd(sub) as dfd:
                name = f".probe.{os.getpid()}.{threading.get_native_id()}"
                os.close(create_temp(name, dfd))
                os.unlink(name, dir_fd=dfd)
        except OSError as e:
            raise SsdDirError(path, f"cannot write in {sub}: {_why(e)}") from None
    try:
        index = SsdIndex(os.path.join(path, "index"), payloads)
    except (OSError, lmdb.Error) as e:
        raise SsdDirError(path, f"cannot open its index: {_why(e)}") from None
    try:
        index.probe()
    except (OSError, lmdb.Error) as e:
        raise SsdDirError(path, f"cannot write its index: {_why(e)}") from None
    finally:
        index.close()


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror if e.filename is None else f"{e.strerror} ({e.filename})"
    return f"{type(e).__name__}: {e}"
