"""Payload files on disk: their names, and opening them without following symlinks.

A block's payload lives at ``blocks/ab/<key hex>.safetensors`` (256-way
fan-out by the key's first byte); a write goes through a temp file named with
the writer's pid and thread id beside it. Every open goes through the fan-out
directory's descriptor with ``O_NOFOLLOW``, so a symlink planted in the
directory (as the file or as its fan-out directory) is refused, never followed
out of it; files and directories are created owner-only (0600 / 0700).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from ...errors import PayloadError

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


def payload_path(root: str, key: bytes) -> str:
    """``root/ab/abcdef....safetensors``: content-addressed, 256-way fan-out."""
    name = key.hex()
    return os.path.join(root, name[:2], name + SUFFIX)


def temp_path(final: str, pid: int, tid: int) -> str:
    """Temp name beside ``final``: unique per process and thread."""
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail[: -len(SUFFIX)]}.{pid}.{tid}{TEMP_SUFFIX}")


def temp_owner(path: str) -> int:
    """The pid in a temp file name (0 if it has none)."""
    parts = os.path.basename(path).split(".")
    return int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else 0


def open_payload(path: str) -> int:
    """A read-only descriptor of a payload file; symlinks are refused.

    Raises:
        FileNotFoundError: the file (or its fan-out directory) does not exist.
        PayloadError: the file or its fan-out directory is a symlink, or not a
            regular file.
        OSError: it cannot be opened now.
    """
    head, name = os.path.split(path)
    try:
        with parent_fd(head) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise _refused(e, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PayloadError(f"payload {path} is not a regular file")
    return fd


@contextlib.contextmanager
def parent_fd(path: str, *, create: bool = False) -> Iterator[int]:
    """A descriptor of fan-out directory ``path`` (made 0700 if ``create``), not a symlink."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
    dfd = os.open(path, _DIR_FLAGS)  # ELOOP if it is a symlink
    try:
        yield dfd
    finally:
        os.close(dfd)


def create_temp(name: str, dfd: int) -> int:
    """Create temp file ``name`` in directory ``dfd`` (0600); a stale one is replaced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    try:
        return os.open(name, flags, FILE_MODE, dir_fd=dfd)
    except FileExistsError:  # left by a dead writer of the same pid and thread id
        os.unlink(name, dir_fd=dfd)
        return os.open(name, flags, FILE_MODE, dir_fd=dfd)


def list_files(root: str) -> tuple[dict[bytes, str], list[str]]:
    """All payload files under ``root`` by key, and all temp files (for reconcile)."""
    payloads: dict[bytes, str] = {}
    temps: list[str] = []
    for sub in _scandir(root):
        if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
            continue
        for entry in _scandir(sub.path):
            if entry.name.endswith(TEMP_SUFFIX):
                temps.append(entry.path)
            elif entry.name.endswith(SUFFIX):
                try:
                    payloads[bytes.fromhex(entry.name[: -len(SUFFIX)])] = entry.path
                except ValueError:
                    temps.append(entry.path)  # not ours to keep: a stray name
    return payloads, temps


def unlink(path: str) -> None:
    """Remove a file (a symlink itself, not its target); one already gone is fine.

    Goes through the fan-out directory's descriptor: nothing is removed through
    a fan-out directory that is a symlink.
    """
    head, name = os.path.split(path)
    try:
        with parent_fd(head) as dfd:
            os.unlink(name, dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EMLINK):
            raise


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _refused(e: OSError, path: str) -> OSError:
    """ELOOP (a symlink met with O_NOFOLLOW) and ENOTDIR become a verdict on the file."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # EMLINK: FreeBSD's ELOOP
        return PayloadError(f"payload path {path} is a symlink or not a directory: not followed")
    return e
