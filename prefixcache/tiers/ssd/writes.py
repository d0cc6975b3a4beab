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
from dataclasses import dataclass

import lmdb

from ...blocks import BlockMeta
from ...config import CacheConfig
from ...shares_config import tier_shares
from ..base import BlockListener
from ..run_length import RunHints
from ..writer import WriteItem
from . import run_layout, runfiles
from .batch_order import newest_first
from .files import create_temp, parent_fd, payload_path, unlink
from .health import Counts, Health
from .index import SsdIndex
from .payload import DATA_ALIGN, MAX_HEADER, encode_header, write_payload
from .runfiles import RunRef
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
        self.run_tokens = config.ssd_run_tokens
        self.run_growth = config.ssd_run_growth
        self.hints: dict[bytes, RunHints] = {}  # per root: how its run files are cut
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
        files = self._files(items)
        fs_block = os.statvfs(self.payloads).f_frsize
        wanted = [
            (f.key, f.file_bytes, _footprint(f.file_bytes, fs_block), tenant, len(f.items))
            for f in files
            for tenant in [f.items[0].block.tenant]
        ]
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
        accepted = set(res.accepted)
        todo = [f for f in files if f.key in accepted]
        refused = sum(len(f.items) for f in files if f.key not in accepted)
        self.counts.add("num_no_room", refused - res.num_existing)
        written: list[BlockMeta] = []
        try:
            self._write_files(todo, written)
        finally:  # release the reservations even if a write failed
            try:
                self._finish(res.accepted, written, todo)
            finally:
                num = sum(len(f.items) for f in todo)
                self.counts.add(
                    "num_dropped_writes", num - len(written) + refused - res.num_existing
                )

    def _files(self, items: list[WriteItem]) -> list[PayloadFile]:
        """The batch's payload files: its runs of blocks (runfiles.py), one file
        each, and every other block in a file of its own."""
        files = []
        runs = runfiles.group(self._unindexed(items), self.run_tokens, self.run_growth, self.hints)
        for run in runs:
            hints = self.hints.get(run[0].block.root)
            whole = () if hints is None else hints.whole
            if len(run) > 1 and (of_run := PayloadFile.of_run(run, whole)) is not None:
                files.append(of_run)
                continue
            for item in run:  # a block alone (or a run whose header would be too long)
                if (header := self._header(item)) is not None:
                    files.append(
                        PayloadFile(item.block.key, [item], len(header) + item.nbytes, header)
                    )
        return newest_first(files, items)

    def _unindexed(self, items: list[WriteItem]) -> list[WriteItem]:
        """``items`` not indexed yet (another process may have written some)."""
        raws = self.index.get_many([it.block.key for it in items])
        out = [it for it, raw in zip(items, raws, strict=True) if raw is None]
        self.counts.add("num_existing", len(items) - len(out))
        return out

    def report_removed(self, keys: Sequence[bytes]) -> None:
        """Tell the listener (KV events) blocks left the tier."""
        if self.listener is not None and keys:
            self.listener.removed("ssd", keys)

    def _header(self, item: WriteItem) -> bytes | None:
        try:
            return encode_header(item.tensors, item.block.key)
        except ValueError as e:  # too many tensors for a header readers accept
            if self.counts.add("num_unwritable") == 1:
                logger.warning("SSD tier: block %s not written: %s", item.block.key.hex(), e)
            self.counts.add("num_dropped_writes")
            return None

    def _finish(
        self, reserved: list[bytes], written: list[BlockMeta], files: list[PayloadFile]
    ) -> None:
        runs = {k: v for f in files for k, v in f.refs().items()}
        try:
            self.index.finish_writes(reserved, written, write_budget=self.write_budget, runs=runs)
            if self.listener is not None and written:
                self.listener.stored("ssd", written)
        except TierError:
            for key in {runs[m.key][0].file_key if m.key in runs else m.key for m in written}:
                unlink(payload_path(self.payloads, key))
            written.clear()
            raise
        finally:
            self.counts.add("num_writes", len(written))
            self.counts.add("written_bytes", _bytes_written(written, runs))

    def _write_files(self, files: list[PayloadFile], written: list[BlockMeta]) -> None:
        """Write payloads, appending their blocks' metas as each lands (kept if a
        later one fails)."""
        for f in files:
            header, tensors = f.header, f.items[0].tensors
            if f.run is not None:
                tensors = run_layout.tensors(f.items, f.whole)
                header = encode_header(tensors, f.key, run=f.run)
            file_bytes, checksum = write_payload(
                payload_path(self.payloads, f.key), header, tensors
            )
            now = time.time()
            for item in f.items:
                written.append(
                    BlockMeta.of(item.block, file_bytes=file_bytes, checksum=checksum, now=now)
                )


@dataclass(slots=True)
class PayloadFile:
    """One payload file to write: a block's own, or a run of blocks' (``run``: its
    header's run metadata)."""

    key: bytes
    items: list[WriteItem]
    file_bytes: int  # as reserved
    header: bytes = b""  # a block's own file's (a run file's is made as it is written)
    run: str | None = None
    whole: tuple[str, ...] = ()  # a run file's layers kept whole (run_layout.joined)

    @classmethod
    def of_run(cls, items: list[WriteItem], whole: tuple[str, ...] = ()) -> PayloadFile | None:
        """The run file of ``items``; None if its header would be too long for readers."""
        keys = [it.block.key for it in items]
        key = runfiles.file_key(keys)
        run = runfiles.metadata(items[0].block.num_tokens, keys)
        specs = run_layout.layout(items, whole)
        try:
            header = encode_header(specs, key, [(0, 0)] * len(specs), run)  # fixed width digests
        except ValueError:
            return None
        bound = len(header) + 24 * len(specs) + DATA_ALIGN  # as written: a few digits more
        if bound > MAX_HEADER:
            return None
        # reserved: the run's header bound by its tensors' with no data (their offsets
        # take a few more digits each, the padding up to one boundary more), the
        # file's size once written
        size = bound + sum(it.nbytes for it in items)
        return cls(key, items, size, run=run, whole=whole)

    def refs(self) -> dict[bytes, tuple[RunRef, tuple[bytes, ...]]]:
        """Each block's run reference and the run's keys (none for a block's own file)."""
        if self.run is None:
            return {}
        keys = tuple(it.block.key for it in self.items)
        k = len(keys)
        return {key: (RunRef(self.key, j, k), keys) for j, key in enumerate(keys)}


def _bytes_written(written: list[BlockMeta], runs: dict) -> int:
    """File bytes of the files behind ``written`` (a run file's once)."""
    files = {(runs[m.key][0].file_key if m.key in runs else m.key): m.file_bytes for m in written}
    return sum(files.values())


def _free_bytes(path: str) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def _footprint(file_bytes: int, fs_block: int) -> int:
    """Disk space a payload write takes: whole fs blocks plus slack for index and dirs."""
    return -(-file_bytes // fs_block) * fs_block + 6 * fs_block
