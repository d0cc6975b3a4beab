"""SSD tier: blocks kept as safetensors payload files under an LMDB index.

Layout of a directory::

    index/                 LMDB (see index.py)
    blocks/ab/<key hex>.safetensors

``put`` only queues (the caller's thread takes zero-copy byte views of the
already evaluated arrays); a background writer reserves room (evicting LRU
leaves), writes each payload atomically and indexes it. ``load`` serves a
block from the queue while it is pending, else reads and verifies its payload.
A corrupt block is quarantined (entry and file removed), counted, logged once
and becomes a miss. A full disk switches the tier off with one log line.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import lmdb
import mlx.core as mx

from ...blocks import Block, BlockMeta
from ...config import CacheConfig
from ...errors import PayloadError, SsdFormatError
from ..base import Tier, TierReader
from .index import SsdIndex, decode_or_none
from .payload import encode_header, payload_path, read_payload, tensors_of, unlink, write_payload
from .records import SsdRecords
from .writer import WriteItem, Writer

__all__ = ["SsdFormatError", "SsdTier"]

logger = logging.getLogger(__name__)

_MAX_TOUCHES = 4096  # pending LRU touches that wake the writer (else they ride with writes)
_COUNTERS = (
    "num_writes", "written_bytes", "num_dropped_writes", "num_inline_writes", "num_existing",
    "num_no_room", "num_evictions", "num_disk_full", "num_corrupt", "num_loads", "load_bytes",
    "num_pending_loads",
)  # fmt: skip


class SsdTier(Tier):
    """The SSD tier of one directory: put / load / touch blocks, bounded in bytes.

    Args:
        config: ``ssd_dir`` (created if missing), ``ssd_max_bytes`` (cap on the
            payload bytes on disk; LRU leaves are evicted first),
            ``ssd_min_free_bytes`` (free disk a write always leaves),
            ``write_queue_bytes`` and ``queue_full`` (the background writer's
            bound, and ``drop`` or ``inline`` when it is reached).
        map_size: initial LMDB map size (a reservation; it grows on demand).
        writer_hold: an event the writer waits for before each batch (tests).
        record_limits: record the config's limits in the index for inspection
            (off when opened only to inspect or maintain the directory).
    """

    name = "ssd"

    def __init__(
        self,
        config: CacheConfig,
        *,
        map_size: int = 1 << 36,
        writer_hold: threading.Event | None = None,
        record_limits: bool = True,
    ) -> None:
        self.path = config.ssd_path
        self.max_bytes, self.min_free_bytes = config.ssd_max_bytes, config.ssd_min_free_bytes
        self.queue_full = config.queue_full
        self._payloads = os.path.join(self.path, "blocks")
        os.makedirs(self._payloads, exist_ok=True)
        self.index = SsdIndex(os.path.join(self.path, "index"), self._payloads, map_size=map_size)
        self.records = SsdRecords(self.index.path)  # namespaces, counters (the CLI)
        if record_limits:
            self.records.note_limits(max_bytes=self.max_bytes, min_free_bytes=self.min_free_bytes)
        self._enabled, self._closed = True, False
        self._lock = threading.Lock()  # counters and touches
        self._write_lock = threading.Lock()  # writer thread vs inline writes
        self._counts: Counter[str] = Counter()
        self._touches: set[bytes] = set()
        self.writer = Writer(
            self._write_batch,
            max_bytes=config.write_queue_bytes,
            housekeeping=self._apply_touches,
            hold=writer_hold,
        )

    # -- public verbs --------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False once the disk filled up: puts are no-ops, loads still work."""
        return self._enabled

    def payload_file(self, key: bytes) -> str:
        """Where ``key``'s payload file is (whether or not it exists)."""
        return payload_path(self._payloads, key)

    def put(self, block: Block) -> bool:
        """Queue a block (arrays already evaluated); False if the write was dropped."""
        if self._closed:
            raise RuntimeError(f"SSD tier {self.path} is closed")
        if not self._enabled:
            return False
        if self.writer.pending(block.key) is not None or self.index.get(block.key) is not None:
            return True
        nbytes = block.nbytes or sum(a.nbytes for a in block.arrays.values())
        item = WriteItem(block, tensors_of(block.arrays), nbytes)
        if self.writer.submit(item):
            return True
        if self.queue_full == "inline":
            self._count("num_inline_writes")
            return self.writer.run_inline([item])
        self._count("num_dropped_writes")
        return False

    def contains(self, key: bytes) -> bool:
        return self.writer.pending(key) is not None or self.index.get(key) is not None

    def entry(self, key: bytes) -> BlockMeta | None:
        return self.get_meta(key)

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        from .stream import SsdReader  # reader threads: only once a restore needs them

        return SsdReader(self, keys)

    def note_namespace(self, root: bytes, namespace_json: str) -> None:
        self.records.note_namespace(root, namespace_json)

    def save_counters(self, root: bytes, delta: Mapping[str, object]) -> None:
        self.records.add_counters(root, delta)

    def get_meta(self, key: bytes) -> BlockMeta | None:
        """The index fields of a block (queued or indexed); never reads the payload."""
        item = self.writer.pending(key)
        if item is not None:
            return BlockMeta.of(item.block, now=item.queued)
        raw = self.index.get(key)
        meta = decode_or_none(key, raw)
        if raw is not None and meta is None:
            self._quarantine(key, raw, "bad index entry")
        return meta

    def load(self, key: bytes) -> Block | None:
        """The block with fresh arrays, or None (absent, or corrupt and now quarantined)."""
        item = self.writer.pending(key)
        if item is not None:
            self._count("num_pending_loads")
            return _fresh(item.block)
        raw = self.index.get(key)
        meta = decode_or_none(key, raw)
        if meta is None:
            if raw is not None:
                self._quarantine(key, raw, "bad index entry")
            return None
        try:
            path = self.payload_file(key)
            arrays, nbytes = read_payload(path, key, meta.file_bytes, meta.checksum)
            if nbytes != meta.nbytes:
                raise PayloadError(f"payload holds {nbytes} bytes, index says {meta.nbytes}")
        except (PayloadError, FileNotFoundError) as e:
            self._quarantine(key, raw, str(e) or type(e).__name__)
            return None
        except OSError as e:  # unreadable now (EMFILE, EIO...): a miss, not a verdict
            logger.warning("SSD tier: cannot read block %s: %s", key.hex(), e)
            return None
        self._note_load(key, nbytes)
        return Block(key, meta.parent, meta.root, meta.index, meta.tokens, arrays, nbytes)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks as used now (LRU); applied by the writer with its next batch."""
        with self._lock:
            self._touches.update(keys)
            many = len(self._touches) >= _MAX_TOUCHES
        if many:
            self.writer.wake()

    def flush(self) -> None:
        """Wait until everything queued so far is on disk and indexed."""
        self.writer.flush()

    def close(self) -> None:
        """Flush, stop the writer, close the index; re-raises a writer failure once."""
        if self._closed:
            return
        self._closed = True
        try:
            self.writer.close()
        finally:
            self.records.close()
            self.index.close()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        return {
            "enabled": int(self._enabled),
            **self.index.totals(),
            "max_bytes": self.max_bytes,
            "queue_depth": self.writer.queue_depth,
            "queue_bytes": self.writer.queue_bytes,
            "num_write_failures": self.writer.num_failures,
            **{name: counts.get(name, 0) for name in _COUNTERS},
        }

    def iter_meta(self) -> Iterator[BlockMeta]:
        """Every indexed block's meta, read in chunks (short transactions)."""
        start = b""
        while True:
            rows = self.index.scan(start, 1024)
            for key, raw in rows:
                meta = decode_or_none(key, raw)
                if meta is not None:
                    yield meta
            if len(rows) < 1024:
                return
            start = rows[-1][0] + b"\0"

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks from the index and disk; returns how many were indexed."""
        return self.index.remove(keys)

    def evict_to(self, nbytes: int) -> int:
        """Evict LRU leaves until at most ``nbytes`` are stored; returns blocks evicted."""
        num = self.index.evict_to(nbytes)
        self._count("num_evictions", num)
        return num

    def reconcile(self) -> tuple[int, int]:
        """Full scan (``gc``): (orphan files removed, dangling entries removed)."""
        return self.index.reconcile()

    # -- internals ----------------------------------------------------------

    def _count(self, name: str, num: int = 1) -> None:
        with self._lock:
            self._counts[name] += num

    def _note_load(self, key: bytes, nbytes: int) -> None:
        """Count a served payload read (also the stream's) and touch it for the LRU."""
        with self._lock:
            self._counts["num_loads"] += 1
            self._counts["load_bytes"] += nbytes
            self._touches.add(key)

    def _quarantine(self, key: bytes, raw: bytes, reason: str) -> None:
        """Drop a corrupt entry and its file; count it and log the first one."""
        try:
            dropped = self.index.quarantine(key, raw)
        except lmdb.Error as e:  # e.g. disk full: the block is still never served
            logger.debug("SSD tier: could not quarantine %s: %s", key.hex(), e)
            dropped = True
        if not dropped:
            return  # evicted or replaced meanwhile: a plain miss
        with self._lock:
            self._counts["num_corrupt"] += 1
            first = self._counts["num_corrupt"] == 1
        log = logger.warning if first else logger.debug
        log("SSD tier %s: corrupt block %s quarantined (%s)", self.path, key.hex(), reason)

    def _disable(self, reason: object) -> None:
        with self._lock:
            self._counts["num_disk_full"] += 1
            was_enabled, self._enabled = self._enabled, False
        if was_enabled:
            logger.error(
                "SSD tier %s disabled: disk full (%s); continuing without SSD writes, "
                "stored blocks stay readable",
                self.path,
                reason,
            )

    def _apply_touches(self) -> None:
        with self._lock:
            keys, self._touches = self._touches, set()
        if keys and self._enabled:
            try:
                self.index.touch(sorted(keys), time.time())
            except lmdb.DiskError as e:
                self._disable(e)

    def _write_batch(self, items: list[WriteItem]) -> None:
        """Reserve room, write payload files, index them (writer thread or inline)."""
        self._apply_touches()
        with self._write_lock:
            if not self._enabled:
                self._count("num_dropped_writes", len(items))
                return
            headers = {it.block.key: encode_header(it.tensors, it.block.key) for it in items}
            fs = os.statvfs(self._payloads)
            wanted = []
            for it in items:
                file_bytes = len(headers[it.block.key]) + it.nbytes
                wanted.append((it.block.key, file_bytes, _footprint(file_bytes, fs.f_frsize)))
            try:
                res = self.index.reserve(
                    wanted,
                    max_bytes=self.max_bytes,
                    min_free_bytes=self.min_free_bytes,
                    free_bytes=fs.f_bavail * fs.f_frsize,
                )
            except lmdb.DiskError as e:
                self._disable(e)
                self._count("num_dropped_writes", len(items))
                return
            self._count("num_existing", res.num_existing)
            self._count("num_evictions", res.num_evicted)
            self._count("num_no_room", res.num_no_room)
            accepted = set(res.accepted)
            todo = [it for it in items if it.block.key in accepted]
            written: list[BlockMeta] = []
            try:
                self._write_files(todo, headers, written)
            finally:  # release the reservations even if a write failed
                self._finish(res.accepted, written)
                self._count("num_dropped_writes", len(todo) - len(written) + res.num_no_room)

    def _finish(self, reserved: list[bytes], written: list[BlockMeta]) -> None:
        try:
            self.index.finish_writes(reserved, written)
        except lmdb.DiskError as e:
            self._disable(e)
            for meta in written:
                unlink(self.payload_file(meta.key))
            written.clear()
        self._count("num_writes", len(written))
        self._count("written_bytes", sum(m.file_bytes for m in written))

    def _write_files(
        self, items: list[WriteItem], headers: dict[bytes, bytes], written: list[BlockMeta]
    ) -> None:
        """Write payloads, appending each one's meta as it lands (kept if a later one fails)."""
        for item in items:
            key = item.block.key
            try:
                file_bytes, checksum = write_payload(
                    self.payload_file(key), headers[key], item.tensors
                )
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                self._disable(e)
                break
            meta = BlockMeta.of(
                item.block, file_bytes=file_bytes, checksum=checksum, now=time.time()
            )
            written.append(meta)


def _footprint(file_bytes: int, fs_block: int) -> int:
    """Disk space a payload write takes: whole fs blocks plus slack for index and dirs."""
    return -(-file_bytes // fs_block) * fs_block + 4 * fs_block


def _fresh(block: Block) -> Block:
    """A copy of a pending block with new array objects (the queue keeps its own)."""
    arrays = {name: mx.array(arr) for name, arr in block.arrays.items()}
    mx.eval(arrays)
    return Block(
        block.key, block.parent, block.root, block.index, block.tokens, arrays, block.nbytes
    )
