"""The SSD tier's read side, one object the tier and its reader threads share.

It serves a block (from the writer's queue while pending, else its payload
file, verified), counts served loads and touches them for the LRU (the writer
applies the touches with its next batch), and notes what goes wrong: a payload
that cannot be read now (a miss, not a verdict) and a corrupt block
(quarantined, counted, logged once). The stream and its readers are handed
this object, never the tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import mlx.core as mx

from ...blocks import Block, BlockMeta
from ...errors import PayloadError
from ..writer import Writer
from . import run_layout
from .files import payload_path
from .health import Counts
from .index import SsdIndex, decode_or_none
from .payload import read_header, read_payload
from .run_reads import LastRunFile
from .writes import SsdWrites, TierError

logger = logging.getLogger(__name__)
_HEADERS = 64  # payload headers kept parsed (``SsdReads._header``)

_MAX_TOUCHES = 4096  # pending LRU touches that wake the writer (else they ride with writes)


class SsdReads:
    """Loads, read notes and LRU touches of one SSD tier directory."""

    def __init__(
        self,
        index: SsdIndex,
        writer: Writer,
        payloads: str,
        counts: Counts,
        writes: SsdWrites,
    ) -> None:
        self.index = index
        self.writer = writer
        self.path = payloads
        self._counts = counts
        self._writes = writes
        self._lock = threading.Lock()  # touches, kept headers
        self._touches: set[bytes] = set()
        self._runs = LastRunFile()  # single-block loads of run files
        self._headers: dict[tuple[bytes, int], tuple] = {}  # (file key, checksum) -> specs

    def payload_file(self, key: bytes) -> str:
        """Where ``key``'s payload file is (whether or not it exists)."""
        return payload_path(self.path, key)

    def header(self, key: bytes) -> list[tuple[str, mx.Dtype, tuple[int, ...]]]:
        """Block ``key``'s tensors' (name, dtype, shape) from its payload header alone
        (unverified; a run file's tensors cut to one block's tokens).

        Raises:
            OSError: the file cannot be read.
            PayloadError: the header is bad, or the block is not indexed.
        """
        raw, run = self.index.get_runs([key])[0]
        meta = decode_or_none(key, raw)
        if run is None:
            return list(self._header(key, meta))
        specs = self._header(run.file_key, meta)
        out = []
        for name, dt, shape in specs:
            extra = run_layout.split_extra(name)
            if extra is not None:  # a block's own, kept whole
                if extra[1] == run.position:
                    out.append((extra[0], dt, shape))
            elif len(shape) != 4 or shape[2] % run.count:
                raise PayloadError(f"run file {run.file_key.hex()} has tensors of another layout")
            else:
                b, h, t, d = shape
                out.append((name, dt, (b, h, t // run.count, d)))
        return out

    def _header(self, file_key: bytes, meta: BlockMeta | None) -> tuple:
        """``read_header`` of the file, parsed once while the checksum its block's entry
        (``meta``) names holds (a lookup asks for each of a window's blocks: one run file)."""
        if meta is None:
            return tuple(read_header(self.payload_file(file_key), file_key))
        which = (file_key, meta.checksum)
        specs = self._headers.get(which)
        if specs is None:
            specs = tuple(read_header(self.payload_file(file_key), file_key))
            with self._lock:
                self._headers[which] = specs
                if len(self._headers) > _HEADERS:
                    self._headers.pop(next(iter(self._headers)))
        return specs

    def decoded(self, key: bytes, raw: bytes | None) -> BlockMeta | None:
        """The decoded entry; None if absent or unreadable (then quarantined)."""
        meta = decode_or_none(key, raw)
        if raw is not None and meta is None:
            self.quarantine(key, raw, "bad index entry")
        return meta

    def load(self, key: bytes) -> Block | None:
        """The block with fresh arrays, or None (absent, or corrupt and now quarantined)."""
        item = self.writer.pending(key)
        if item is not None:
            self._counts.add("num_pending_loads")
            return item.fresh_block()
        raw, run = self.index.get_runs([key])[0]
        if (meta := self.decoded(key, raw)) is None:
            return None
        try:
            if run is None:
                path = self.payload_file(key)
                arrays, nbytes = read_payload(path, key, meta.file_bytes, meta.checksum)
            else:
                arrays, nbytes = self._runs.block(self.payload_file(run.file_key), meta, run)
            if nbytes != meta.nbytes:
                raise PayloadError(f"payload holds {nbytes} bytes, index says {meta.nbytes}")
        except (PayloadError, FileNotFoundError) as e:
            self.quarantine(key, raw, str(e) or type(e).__name__)
            return None
        except OSError as e:  # unreadable now (EMFILE, EIO...): a miss, not a verdict
            self.read_error(key, e)
            return None
        self.note_loads([key], nbytes)
        return Block(
            key, meta.parent, meta.root, meta.index, meta.tokens, arrays, nbytes, meta.tenant
        )

    def read_error(self, key: bytes, error: OSError) -> None:
        """A payload that cannot be read now (EMFILE, EIO...): a miss, not a verdict."""
        first = self._counts.add("num_read_errors") == 1
        log = logger.warning if first else logger.debug
        log("SSD tier %s: cannot read block %s: %s", self.path, key.hex(), error)

    def note_loads(self, keys: Sequence[bytes], nbytes: int) -> None:
        """Count served payload reads (``nbytes`` in all; a stream's, at its end)
        and touch them for the LRU."""
        if not keys:
            return
        self._counts.add("num_loads", len(keys))
        self._counts.add("load_bytes", nbytes)
        with self._lock:
            self._touches.update(keys)

    def quarantine(self, key: bytes, raw: bytes, reason: str) -> None:
        """Drop a corrupt entry and its file; count it and log the first one."""
        try:
            gone: list[bytes] = []  # a run file's: all its blocks
            dropped = self.index.quarantine(key, raw, gone)  # > 1: other bad entries too
        except TierError as e:  # e.g. disk full: the block is still never served
            logger.debug("SSD tier: could not quarantine %s: %s", key.hex(), e)
            dropped = 1
        if not dropped:
            return  # evicted or replaced meanwhile: a plain miss
        self._writes.report_removed(gone or [key])
        first = self._counts.add("num_corrupt", dropped) == dropped
        log = logger.warning if first else logger.debug
        log("SSD tier %s: corrupt block %s quarantined (%s)", self.path, key.hex(), reason)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks as used now (LRU); applied by the writer with its next batch."""
        with self._lock:
            self._touches.update(keys)
            many = len(self._touches) >= _MAX_TOUCHES
        if many:
            self.writer.wake()

    def take_touches(self) -> list[bytes]:
        """The touches noted since the last call, in key order (the writer's thread)."""
        with self._lock:
            keys, self._touches = self._touches, set()
        return sorted(keys)
