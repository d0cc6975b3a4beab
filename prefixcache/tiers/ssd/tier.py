"""SSD tier: blocks kept as safetensors payload files under an LMDB index.

Layout of a directory::

    index/                 LMDB (see index.py)
    blocks/ab/<key hex>.safetensors

``put`` only queues (the caller's thread takes zero-copy byte views of the
already evaluated arrays); a writer thread reserves room (evicting LRU leaves),
writes each payload atomically and indexes it. ``load`` serves a block from the
queue while pending, else reads and verifies its payload; tails are kept and
listed (``children``) like blocks. A corrupt block (or a symlinked payload: never
followed) is quarantined, counted, logged once and becomes a miss. A disk or
index failure at run time (full, read-only, gone, I/O error) turns writes off
with one log line and is retried (health.py, writes.py): never raised to the cache.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Container, Iterator, Mapping, Sequence

from ...blocks import Block, BlockMeta
from ...config import CacheConfig
from ...errors import PayloadError
from ...memory.host import tensors_of
from ..base import ChainEntry, ListsChildren, Tier, TierReader
from ..writer import WriteItem, Writer
from .controls import SsdControls
from .directory import open_dir
from .files import payload_path
from .health import Counts, Health
from .index import SsdIndex, decode_or_none
from .payload import read_header, read_payload
from .read_notes import SsdReadNotes
from .records import SsdRecords
from .writes import SsdWrites

logger = logging.getLogger(__name__)

_MAX_TOUCHES = 4096  # pending LRU touches that wake the writer (else they ride with writes)


class SsdTier(SsdControls, SsdReadNotes, ListsChildren, Tier):
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
    metered = True

    def __init__(
        self,
        config: CacheConfig,
        *,
        map_size: int = 1 << 36,
        writer_hold: threading.Event | None = None,
        record_limits: bool = True,
    ) -> None:
        self.path = config.ssd_path
        self.queue_full = config.queue_full
        self._payloads = open_dir(self.path)
        self.index = SsdIndex(os.path.join(self.path, "index"), self._payloads, map_size=map_size)
        self.records = SsdRecords(self.index.path)  # namespaces, counters (the CLI)
        if record_limits:
            self.records.note_limits(
                max_bytes=config.ssd_max_bytes,
                min_free_bytes=config.ssd_min_free_bytes,
                write_budget=config.ssd_write_budget,
            )
        self._closed = False
        self._lock = threading.Lock()  # touches
        self._counts = Counts()
        self.health = Health(self.path, config.ssd_retry_seconds, self._counts)
        self._writes = SsdWrites(self.index, self._payloads, config, self._counts, self.health)
        self._touches: set[bytes] = set()
        self.writer = Writer(
            self._write_batch,
            max_bytes=config.write_queue_limit,
            housekeeping=self._housekeeping,
            hold=writer_hold,
        )

    @property
    def enabled(self) -> bool:
        """False after a disk or index failure until a retry works (reads go on)."""
        return self.health.enabled

    @property
    def max_bytes(self) -> int:
        """Cap on the payload bytes on disk (settable: the next write evicts down to it)."""
        return self._writes.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._writes.max_bytes = value

    def payload_file(self, key: bytes) -> str:
        """Where ``key``'s payload file is (whether or not it exists)."""
        return payload_path(self._payloads, key)

    def put(self, block: Block) -> bool:
        """Queue a block (arrays already evaluated); False if the write was dropped."""
        if self._closed:
            raise RuntimeError(f"SSD tier {self.path} is closed")
        if not self.health.enabled:
            self._counts.add("num_dropped_writes")
            if self.health.retry_due():
                self.writer.wake()  # the writer probes the directory
            return False
        if self.writer.pending(block.key) is not None or self.index.get(block.key) is not None:
            return True
        nbytes = block.nbytes or sum(a.nbytes for a in block.arrays.values())
        item = WriteItem(block, tensors_of(block.arrays), nbytes)
        if self.writer.submit(item):
            return True
        if self.queue_full == "inline":
            self._counts.add("num_inline_writes")
            return self.writer.run_inline([item])
        self._counts.add("num_dropped_writes")
        return False

    def contains(self, key: bytes) -> bool:
        return self.writer.pending(key) is not None or self.index.get(key) is not None

    def entry(self, key: bytes) -> BlockMeta | None:
        return self.get_meta(key)

    def held(self, keys: Sequence[bytes], start: int) -> list[ChainEntry]:
        """As ``entry`` for ``keys[start:]`` while held, the index read in one
        transaction per run of indexed keys (one for a chain written out)."""
        out: list[ChainEntry] = []
        pos = start
        while pos < len(keys):
            raws = self.index.get_many(keys[pos:], until_absent=True)
            for key, raw in zip(keys[pos:], raws, strict=False):
                item = self.writer.pending(key)
                if item is not None:
                    meta = BlockMeta.of(item.block, now=item.queued)
                elif (meta := self._decoded(key, raw)) is None:
                    return out
                out.append(meta)
            pos += len(raws)
        return out

    def payload_names(self, key: bytes) -> Container[str] | None:
        item = self.writer.pending(key)  # else the header's: unverified, the load checks
        if item is not None:
            return item.block.arrays
        try:
            return {name for name, _, _ in read_header(self.payload_file(key), key)}
        except (OSError, PayloadError):
            return None

    def children(self, parent: bytes) -> list[BlockMeta]:
        """Blocks and tails queued or indexed under ``parent`` (bad entries quarantined)."""
        found = {key: self._decoded(key, raw) for key, raw in self.index.children(parent)}
        for item in self.writer.pending_children(parent):
            found[item.block.key] = BlockMeta.of(item.block, now=item.queued)
        return [meta for meta in found.values() if meta is not None]

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
        return self._decoded(key, self.index.get(key))

    def load(self, key: bytes) -> Block | None:
        """The block with fresh arrays, or None (absent, or corrupt and now quarantined)."""
        item = self.writer.pending(key)
        if item is not None:
            self._counts.add("num_pending_loads")
            return item.fresh_block()
        raw = self.index.get(key)
        if (meta := self._decoded(key, raw)) is None:
            return None
        try:
            path = self.payload_file(key)
            arrays, nbytes = read_payload(path, key, meta.file_bytes, meta.checksum)
            if nbytes != meta.nbytes:
                raise PayloadError(f"payload holds {nbytes} bytes, index says {meta.nbytes}")
        except (PayloadError, FileNotFoundError) as e:
            self.quarantine(key, raw, str(e) or type(e).__name__)
            return None
        except OSError as e:  # unreadable now (EMFILE, EIO...): a miss, not a verdict
            self.read_error(key, e)
            return None
        self.note_load(key, nbytes)
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
        counts = self._counts.every()
        return {
            "enabled": int(self.health.enabled),
            **self.index.totals(),
            "max_bytes": self.max_bytes,
            "queue_depth": self.writer.queue_depth,
            "queue_bytes": self.writer.queue_bytes,
            "queue_max_bytes": self.writer.max_bytes,
            "num_write_failures": self.writer.num_failures,
            **counts,
            **self.control_stats(),
        }

    def iter_meta(self) -> Iterator[BlockMeta]:
        """Every indexed block's meta, read in chunks (short transactions)."""
        return (m for k, raw in self.index.rows() if (m := decode_or_none(k, raw)) is not None)

    def _decoded(self, key: bytes, raw: bytes | None) -> BlockMeta | None:
        """The decoded entry; None if absent or unreadable (then quarantined)."""
        meta = decode_or_none(key, raw)
        if raw is not None and meta is None:
            self.quarantine(key, raw, "bad index entry")
        return meta

    def _write_batch(self, items: list[WriteItem]) -> None:
        self._apply_touches()  # before the batch's evictions pick LRU leaves
        self._writes.write_batch(items)

    def _housekeeping(self) -> None:
        """On the writer thread after each batch: the retry probe, LRU touches."""
        if self.health.retry_due():
            self._writes.probe()
        self._apply_touches()

    def _apply_touches(self) -> None:
        with self._lock:
            keys, self._touches = self._touches, set()
        self._writes.touch(sorted(keys))
