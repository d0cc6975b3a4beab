"""Payload files on disk: their names, and opening them without following symlinks.

A block's payload lives at ``blocks/ab/<key hex>.safetensors`` (256-way
fan-out by the key's first byte); a write goes through a temp file named with
the writer's pid and thread id beside it. Every open goes through the fan-out
directory's descriptor with ``O_NOFOLLOW``, so a symlink planted in the
directory (as the file or as its fan-out directory) is refused, never followed
out of it; files and directories are created owner-only (0600 / 0700).

A restore opens many files: ``PayloadRoot`` holds the payloads' root open and
opens each file relative to it, in ONE ``openat2`` call that refuses a symlink
anywhere below the root (``RESOLVE_NO_SYMLINKS``) where the kernel has it (Linux
5.6+), else fan-out directory then file as above; either way one ``fstat``
checks it is a regular file and gives its size.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator

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
    """A read-only descriptor of a payload file, a regular file; symlinks are refused.

    Raises:
        FileNotFoundError: the file (or its fan-out directory) does not exist.
        PayloadError: the file or its fan-out directory is a symlink, or not a
            regular file.
        OSError: it cannot be opened now.
    """
    return open_sized(path)[0]


def open_sized(path: str) -> tuple[int, int]:
    """(``open_payload``'s descriptor, the file's size), from one ``fstat``."""
    head, name = os.path.split(path)
    try:
        with parent_fd(head) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise _refused(e, path) from None
    return _regular(fd, path)


def _regular(fd: int, path: str) -> tuple[int, int]:
    """(``fd``, its size) if it is a regular file; else closed and refused."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PayloadError(f"payload {path} is not a regular file")
    return fd, st.st_size


class PayloadRoot:
    """The payloads' root directory (``root``: followed if a symlink, as a path to
    it is), held open while a restore opens its files relative to it. Close it
    when done; safe to share between threads."""

    def __init__(self, root: str):
        self.root = root
        self._prefix = os.path.join(root, "")
        self._fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)

    def open(self, path: str) -> tuple[int, int]:
        """(a read-only descriptor, its size) of payload file ``path`` (under the
        root), a regular file reached through no symlink.

        Raises:
            FileNotFoundError: the file (or its fan-out directory) does not exist.
            PayloadError: the file or its fan-out directory is a symlink, or not
                a regular file.
            OSError: it cannot be opened now.
        """
        if not path.startswith(self._prefix) or self._fd < 0:
            return open_sized(path)
        rel = path[len(self._prefix) :]
        try:
            fd = _beneath(self._fd, rel)
            if fd is None:  # no openat2: fan-out directory, then the file in it
                head, name = os.path.split(rel)
                dfd = os.open(head, _DIR_FLAGS, dir_fd=self._fd)
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
                finally:
                    os.close(dfd)
        except OSError as e:
            raise _refused(e, path) from None
        return _regular(fd, path)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_HOW = _OpenHow(os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
_HOW_AT, _HOW_SIZE = ctypes.addressof(_HOW), ctypes.sizeof(_HOW)


def _load_openat2() -> Callable[..., int] | None:
    """libc's ``syscall``, set to call openat2, where its number is known (437 on these)."""
    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return call


# None where the kernel lacks openat2, or is found to (then never asked again)
openat2: Callable[..., int] | None = _load_openat2()


def _beneath(dfd: int, rel: str) -> int | None:
    """``rel`` opened read-only below directory ``dfd`` through no symlink (one
    ``openat2``), or None where the kernel lacks openat2.

    Raises:
        OSError: ELOOP where a symlink is met, EXDEV where ``rel`` leaves ``dfd``.
    """
    global openat2
    call = openat2  # one read: another thread may clear it
    if call is None:
        return None
    fd = call(_SYS_OPENAT2, dfd, os.fsencode(rel), _HOW_AT, _HOW_SIZE)
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # an old kernel, or a filter that forbids it
        openat2 = None
        return None
    raise OSError(err, os.strerror(err), rel)


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
    # EMLINK: FreeBSD's ELOOP; EXDEV: openat2 met a path leaving the root
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.EXDEV):
        return PayloadError(f"payload path {path} is a symlink or not a directory: not followed")
    return e
