"""SSD tier: blocks kept as safetensors payload files under an LMDB index.

Layout of a directory::

    index/                 LMDB (see index.py)
    blocks/ab/<key hex>.safetensors   a block's payload, or a run file's (runfiles.py)

``put`` only queues (the caller's thread takes zero-copy byte views of the
already evaluated arrays); a writer thread reserves room (evicting LRU leaves),
writes each payload atomically (a batch's consecutive blocks of a chain as run
files) and indexes it. ``load`` serves a block from the
queue while pending, else reads and verifies its payload; tails are kept and
listed (``children``) like blocks. A corrupt block (or a symlinked payload: never
followed) is quarantined, counted, logged once and becomes a miss. A disk or
index failure at run time (full, read-only, gone, I/O error) turns writes off
with one log line and is retried (health.py, writes.py): never raised to the cache.
The tier also answers the contract's operator hooks: pins kept in its index (they
survive a restart; pinning.py), its write budget (budget.py), its events, and
each tenant's share, kept in its index too (shares.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Container, Iterator, Mapping, Sequence

from ...blocks import Block, BlockMeta
from ...config import CacheConfig
from ...errors import PayloadError, PinCapacityError
from ...memory.host import tensors_of
from ..base import (
    BlockListener,
    ChainEntry,
    KeepsPins,
    ListsChildren,
    Metered,
    Persistent,
    ReportsEvents,
    SharesTenants,
    Tier,
    TierReader,
)
from ..run_length import NO_HINTS, RunHints
from ..writer import WriteItem, Writer
from .directory import open_dir
from .health import Counts, Health
from .index import SsdIndex, decode_or_none
from .payload import encode_header
from .reads import SsdReads
from .recent import recent_chains
from .records import SsdRecords
from .shares import COUNTERS, FIELDS
from .writes import SsdWrites

logger = logging.getLogger(__name__)

# A batch waits for more blocks while they keep coming, each within this many seconds
# (at most 8x from its first): a store's blocks go in one batch, so in run files.
_LINGER = 0.005


class SsdTier(ListsChildren, KeepsPins, Persistent, Metered, ReportsEvents, SharesTenants, Tier):
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
        self._counts = Counts()
        self.health = Health(self.path, config.ssd_retry_seconds, self._counts)
        self._writes = SsdWrites(self.index, self._payloads, config, self._counts, self.health)
        self.writer = Writer(
            self._write_batch,
            max_bytes=config.write_queue_limit,
            housekeeping=self._housekeeping,
            hold=writer_hold,
            run_tokens=config.ssd_run_tokens,
            run_growth=config.ssd_run_growth,
            linger=_LINGER if config.ssd_run_tokens else 0.0,
        )
        self.reads = SsdReads(self.index, self.writer, self._payloads, self._counts, self._writes)

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
        """Where ``key``'s payload file is (whether or not it exists): its run file's
        while the index says it lies in one (runfiles.py)."""
        run = self.index.get_runs([key])[0][1]
        return self.reads.payload_file(key if run is None else run.file_key)

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
        self._writes.queue_refused(block.tenant)  # counted per tenant by the writer thread
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
            items = self.writer.pending_many(keys[pos : pos + len(raws)])
            for key, raw, item in zip(keys[pos:], raws, items, strict=False):
                if item is not None:
                    meta = BlockMeta.of(item.block, now=item.queued)
                elif (meta := self.reads.decoded(key, raw)) is None:
                    return out
                out.append(meta)
            pos += len(raws)
        return out

    def payload_names(self, key: bytes) -> Container[str] | None:
        item = self.writer.pending(key)  # else the header's: unverified, the load checks
        if item is not None:
            return item.block.arrays
        try:
            return {name for name, _, _ in self.reads.header(key)}
        except (OSError, PayloadError):
            return None

    def children(self, parent: bytes, near: bytes | None = None) -> list[BlockMeta]:
        """Blocks and tails queued or indexed under ``parent`` (bad entries quarantined);
        with ``near``, of those indexed only the few nearest to it (nearby.py)."""
        rows = None if near is None else self.index.children_near(parent, near)
        if rows is None:
            rows = self.index.children(parent)
        found = {key: self.reads.decoded(key, raw) for key, raw in rows}
        for item in self.writer.pending_children(parent):
            found[item.block.key] = BlockMeta.of(item.block, now=item.queued)
        return [meta for meta in found.values() if meta is not None]

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        from .stream import SsdReader  # reader threads: only once a restore needs them

        return SsdReader(self.reads, keys)

    def note_namespace(self, root: bytes, namespace_json: str, runs: RunHints = NO_HINTS) -> None:
        self.records.note_namespace(root, namespace_json)
        if runs != NO_HINTS:
            self._writes.hints[root] = runs

    def save_counters(self, root: bytes, delta: Mapping[str, object]) -> None:
        self.records.add_counters(root, delta)

    def namespaces(self) -> Mapping[bytes, str]:
        return self.records.namespaces()

    def get_meta(self, key: bytes) -> BlockMeta | None:
        """The index fields of a block (queued or indexed); never reads the payload."""
        item = self.writer.pending(key)
        if item is not None:
            return BlockMeta.of(item.block, now=item.queued)
        return self.reads.decoded(key, self.index.get(key))

    def load(self, key: bytes) -> Block | None:
        """The block with fresh arrays, or None (absent, or corrupt and now quarantined)."""
        return self.reads.load(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks as used now (LRU); applied by the writer with its next batch."""
        self.reads.touch(keys)

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
            **self._control_stats(),
        }

    def iter_meta(self) -> Iterator[BlockMeta]:
        """Every indexed block's meta, read in chunks (short transactions)."""
        return (m for k, raw in self.index.rows() if (m := decode_or_none(k, raw)) is not None)

    # -- operator hooks: pins, write budget, events, removal on request ----------

    def watch(self, listener: BlockListener) -> None:
        self._writes.listener = listener

    def check_pin(self, blocks: Sequence[Block]) -> None:
        """Raise PinCapacityError if the pinned file bytes would exceed ``ssd_max_bytes``."""
        pinned = self.index.pins()
        held = sum(nbytes for key, (_, nbytes) in pinned.items())
        new = sum(_file_bytes(b) for b in blocks if b.key not in pinned)
        if held + new > self.max_bytes:
            raise PinCapacityError(
                f"pinning {len(blocks)} blocks would hold {held + new} pinned bytes on the "
                f"SSD tier, over ssd_max_bytes={self.max_bytes} ({held} pinned already)"
            )

    def pin(self, blocks: Sequence[Block], until: float) -> None:
        self.index.pin([(b.key, _file_bytes(b)) for b in blocks], until)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.index.unpin(keys)

    def pins(self) -> Mapping[bytes, float]:
        return {key: until for key, (until, _) in self.index.pins().items()}

    def recent(self, max_bytes: int) -> list[BlockMeta]:
        """Pinned chains, then the chains of the most recently used leaves, each
        root-first, while they fit in ``max_bytes`` (one scan of the index)."""
        return recent_chains(self.iter_meta(), self.index.pins(), max_bytes)

    def write_budget_left(self) -> int | None:
        """Budget minus the bucket's level minus the bytes queued (not yet charged)."""
        budget = self._writes.write_budget
        if not budget:
            return None
        level, _ = self.index.written(budget)
        return int(budget - level) - self.writer.queue_bytes

    def _control_stats(self) -> dict[str, int]:
        budget = self._writes.write_budget
        level, today = self.index.written(budget)
        pinned = self.index.pins().values()
        return {
            "written_bytes_today": today,
            "write_budget": budget,
            "write_budget_left": max(0, int(budget - level)) if budget else 0,
            "num_pinned": len(pinned),
            "pinned_bytes": sum(nbytes for _, nbytes in pinned),
        }

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks from the index and disk; returns how many were indexed."""
        removed = self.index.remove_keys(keys)
        self._writes.report_removed(removed)
        return len(removed)

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Each tenant's figures on this tier (all processes), with this process's
        floors and caps."""
        limits, held = self._writes.limits, self.index.tenants()
        for name, num in self._writes.pending_refusals().items():  # not recorded yet
            held.setdefault(name, dict.fromkeys(FIELDS, 0))["num_refused"] += num
        out = {}
        for name in sorted({*held, *limits.floors, *limits.caps}):
            figures = held.get(name, dict.fromkeys(FIELDS, 0))
            floor, cap = limits.floors.get(name, 0), limits.caps.get(name, -1)
            out[name] = {
                "num_blocks": figures["num_blocks"],
                "nbytes": figures["nbytes"],
                "floor_bytes": floor,
                "cap_bytes": cap,
                **{key: figures[key] for key in COUNTERS},
            }
        return out

    def evict_to(self, nbytes: int) -> int:
        """Evict leaves until at most ``nbytes`` are stored (the tenants' floors
        apply); returns blocks evicted."""
        evicted = self.index.evict_to(nbytes, self._writes.limits or None)
        self._counts.add("num_evictions", len(evicted))
        self._writes.report_removed(evicted)
        return len(evicted)

    def _write_batch(self, items: list[WriteItem]) -> None:
        self._apply_touches()  # before the batch's evictions pick LRU leaves
        self._writes.write_batch(items)

    def _housekeeping(self) -> None:
        """On the writer thread after each batch: the retry probe, LRU touches, the
        tenants' refusals for a full queue."""
        if self.health.retry_due():
            self._writes.probe()
        self._apply_touches()
        self._writes.record_refusals()

    def _apply_touches(self) -> None:
        self._writes.touch(self.reads.take_touches())


def _file_bytes(block: Block) -> int:
    """Bytes of ``block``'s payload file: its safetensors header plus its tensors."""
    tensors = tensors_of(block.arrays)
    header = encode_header(tensors, block.key, [(0, 0)] * len(tensors))  # sized: digests unneeded
    return len(header) + sum(t.data.nbytes for t in tensors)
