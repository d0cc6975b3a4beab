"""The SSD tier's write path: reserve room, write payload files, index them.

Runs on the writer thread (or inline, under ``queue_full="inline"``). A
failure of the disk or the index (any OSError or LMDB error) turns the tier's
writes off through :class:`Health` instead of propagating: the items of that
batch are dropped (counted), what was written before it in the batch stays
indexed, and :meth:`SsdWrites.probe` later tells whether writes can resume.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence

import lmdb

from ...blocks import BlockMeta
from ...config import CacheConfig
from ...shares_config import tier_shares
from ..base import BlockListener
from ..writer import WriteItem
from .files import create_temp, parent_fd, payload_path, unlink
from .health import Counts, Health
from .index import SsdIndex
from .payload import encode_header, write_payload
from .shares import Limits

logger = logging.getLogger(__name__)

TierError = (OSError, lmdb.Error)  # what the disk or the index may raise at run time


class SsdWrites:
    """Writes batches of queued blocks into one SSD tier directory.

    Args:
        index: the tier's index.
        payloads: root of the payload files.
        config: ``ssd_max_bytes``, ``ssd_min_free_bytes`` and the tenants' shares.
        counts: the tier's counters.
        health: the tier's on/off state of writes.
    """

    def __init__(
        self, index: SsdIndex, payloads: str, config: CacheConfig, counts: Counts, health: Health
    ) -> None:
        self.index, self.payloads = index, payloads
        self.max_bytes, self.min_free_bytes = config.ssd_max_bytes, config.ssd_min_free_bytes
        self.write_budget = config.ssd_write_budget
        self.limits = Limits(*tier_shares(config, "ssd"))
        self.listener: BlockListener | None = None  # hears what is indexed and evicted
        self.counts, self.health = counts, health
        self._lock = threading.Lock()  # writer thread vs inline writes
        self._refused: Counter[str] = Counter()  # queue-full drops per tenant, to record
        self._refused_lock = threading.Lock()

    def write_batch(self, items: list[WriteItem]) -> None:
        """Reserve room, write payload files, index them; never raises a tier failure."""
        with self._lock:
            if not self.health.enabled:
                self.counts.add("num_dropped_writes", len(items))
                return
            try:
                self._write(items)
            except TierError as e:
                self.health.fail(e)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Apply LRU touches (dropped while writes are off)."""
        if keys and self.health.enabled:
            try:
                self.index.touch(keys, time.time())
            except TierError as e:
                self.health.fail(e)

    def queue_refused(self, tenant: str) -> None:
        """Count a block of ``tenant`` dropped for a full queue (any thread): recorded
        in the index, with the tenant's other refusals, by ``record_refusals``."""
        with self._refused_lock:
            self._refused[tenant] += 1

    def pending_refusals(self) -> dict[str, int]:
        with self._refused_lock:
            return dict(self._refused)

    def record_refusals(self) -> None:
        """Add the queue-full drops counted since the last call to their tenants'
        ``num_refused`` in the index (writer thread; one transaction)."""
        with self._refused_lock:
            refused, self._refused = self._refused, Counter()
        if refused and self.health.enabled:
            try:
                self.index.count_refused(refused)
            except TierError as e:
                self.health.fail(e)

    def probe(self) -> None:
        """Try a payload file, the index and free space; writes resume if all work."""
        try:
            free = _free_bytes(self.payloads)
            if free < self.min_free_bytes:
                raise OSError(28, f"{free} bytes free, below ssd_min_free_bytes")  # ENOSPC
            with parent_fd(self.payloads) as dfd:
                name = f".probe.{os.getpid()}.{threading.get_native_id()}"
                os.close(create_temp(name, dfd))
                os.unlink(name, dir_fd=dfd)
            self.index.probe()
        except TierError as e:
            self.health.still_failing(e)
            return
        self.health.recover()

    def _write(self, items: list[WriteItem]) -> None:
        headers = self._headers(items)
        items = [it for it in items if it.block.key in headers]
        fs_block = os.statvfs(self.payloads).f_frsize
        wanted = []
        for it in items:
            file_bytes = len(headers[it.block.key]) + it.nbytes
            footprint = _footprint(file_bytes, fs_block)
            wanted.append((it.block.key, file_bytes, footprint, it.block.tenant))
        try:
            res = self.index.reserve(
                wanted,
                max_bytes=self.max_bytes,
                min_free_bytes=self.min_free_bytes,
                free_bytes=_free_bytes(self.payloads),
                limits=self.limits or None,
            )
        except TierError:
            self.counts.add("num_dropped_writes", len(items))
            raise
        self.counts.add("num_existing", res.num_existing)
        self.counts.add("num_evictions", res.num_evicted)
        self.report_removed(res.evicted)
        self.counts.add("num_no_room", res.num_no_room + res.num_over_cap)
        accepted = set(res.accepted)
        todo = [it for it in items if it.block.key in accepted]
        written: list[BlockMeta] = []
        try:
            self._write_files(todo, headers, written)
        finally:  # release the reservations even if a write failed
            try:
                self._finish(res.accepted, written)
            finally:
                refused = res.num_no_room + res.num_over_cap
                self.counts.add("num_dropped_writes", len(todo) - len(written) + refused)

    def report_removed(self, keys: Sequence[bytes]) -> None:
        """Tell the listener (KV events) blocks left the tier."""
        if self.listener is not None and keys:
            self.listener.removed("ssd", keys)

    def _headers(self, items: list[WriteItem]) -> dict[bytes, bytes]:
        headers = {}
        for it in items:
            try:
                headers[it.block.key] = encode_header(it.tensors, it.block.key)
            except ValueError as e:  # too many tensors for a header readers accept
                if self.counts.add("num_unwritable") == 1:
                    logger.warning("SSD tier: block %s not written: %s", it.block.key.hex(), e)
                self.counts.add("num_dropped_writes")
        return headers

    def _finish(self, reserved: list[bytes], written: list[BlockMeta]) -> None:
        try:
            self.index.finish_writes(reserved, written, write_budget=self.write_budget)
            if self.listener is not None and written:
                self.listener.stored("ssd", written)
        except TierError:
            for meta in written:
                unlink(payload_path(self.payloads, meta.key))
            written.clear()
            raise
        finally:
            self.counts.add("num_writes", len(written))
            self.counts.add("written_bytes", sum(m.file_bytes for m in written))

    def _write_files(
        self, items: list[WriteItem], headers: dict[bytes, bytes], written: list[BlockMeta]
    ) -> None:
        """Write payloads, appending each one's meta as it lands (kept if a later one fails)."""
        for item in items:
            key = item.block.key
            file_bytes, checksum = write_payload(
                payload_path(self.payloads, key), headers[key], item.tensors
            )
            meta = BlockMeta.of(
                item.block, file_bytes=file_bytes, checksum=checksum, now=time.time()
            )
            written.append(meta)


def _free_bytes(path: str) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def _footprint(file_bytes: int, fs_block: int) -> int:
    """Disk space a payload write takes: whole fs blocks plus slack for index and dirs."""
    return -(-file_bytes // fs_block) * fs_block + 6 * fs_block
