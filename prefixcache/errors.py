"""The package's exceptions and the miss-reason taxonomy.

Misuse raises (``ValueError``/``TypeError`` subclasses below, with the
offending value in the message). A miss is a return value; its reason is a
:class:`MissReason`. Corruption becomes a counted miss, never an exception to
the caller.
"""

from __future__ import annotations

from enum import Enum


class MissReason(str, Enum):
    """Why a fetch did not reuse every full block of the prompt."""

    NO_PREFIX = "no_prefix"  # the next block was never stored
    PARTIAL_BLOCK = "partial_block"  # a stored block shares more tokens than could be cut back
    EVICTED = "evicted"  # the next block was stored, then evicted from every tier
    PENDING_WRITE = "pending_write"  # the next block was dropped from the write queue
    BOUNDARY_MISSING = "boundary_state_missing"  # no recurrent snapshot at the boundary
    WINDOW_NOT_COVERED = "window_not_covered"  # sliding-window tokens not stored
    LAYOUT_MISMATCH = "layout_mismatch"  # stored payload unusable for this layout
    CORRUPT = "corrupt"  # checksum or decode failure on the ssd or remote tier
    TOKEN_MISMATCH = "token_mismatch"  # key matched but stored token ids differ
    REMOTE_UNAVAILABLE = "remote_unavailable"  # the remote server failed, timed out, breaker open
    REMOTE_GATE = "remote_slower_than_prefill"  # the cost gate chose recomputing over fetching


class UnsupportedCacheError(TypeError):
    """A cache type has no registered codec."""


class LayoutMismatchError(ValueError):
    """A cache (or a stored payload) does not fit the layout it is used with.

    Attributes:
        reason: the miss reason a restore records when a payload is unusable.
    """

    def __init__(self, message: str, reason: MissReason = MissReason.LAYOUT_MISMATCH):
        super().__init__(message)
        self.reason = reason


class Shortfall(Exception):
    """A block needed by a restore could not be used; restore fewer blocks."""

    def __init__(self, index: int, reason: MissReason):
        super().__init__(index, reason)
        self.index = index
        self.reason = reason

    @classmethod
    def of(cls, index: int, err: Exception) -> Shortfall:
        """Block ``index`` unusable because of ``err`` (a payload a builder refused)."""
        reason = err.reason if isinstance(err, LayoutMismatchError) else MissReason.LAYOUT_MISMATCH
        return cls(index, reason)


class PayloadError(ValueError):
    """A payload file is malformed, truncated or fails its checksum."""


class SsdFormatError(ValueError):
    """The directory holds an SSD tier of another format version."""


class CacheDirError(Exception):
    """The directory does not exist or holds no prefixcache SSD tier."""


class SsdDirError(OSError):
    """The SSD tier directory cannot be created, is not a directory, or cannot be written.

    Attributes:
        path: the directory.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(f"SSD tier directory {path} is not usable: {reason}")
        self.path = path


class PinCapacityError(ValueError):
    """Pinning these blocks would hold more pinned bytes than a tier's cap allows."""


class ConfigError(ValueError):
    """A setting's value is unusable; the message names the value.

    Attributes:
        field: the CacheConfig field at fault, or None when several are.
        source: the ``PREFIXCACHE_*`` variable the value came from, or None (a
            keyword argument or a command-line flag).
    """

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        super().__init__(message)
        self.field = field
        self.source = source


class MissingExtraError(ImportError):
    """A feature needs an optional dependency that is not installed.

    Attributes:
        extra: the ``prefixcache[...]`` extra that installs it.
    """

    def __init__(self, message: str, extra: str):
        super().__init__(message)
        self.extra = extra
