"""What operators set on the SSD tier: pins kept in its index, its write budget, its events.

:class:`SsdControls` is the part of :class:`~prefixcache.tiers.ssd.tier.SsdTier`
that implements the tier contract's operator hooks (base.py): ``check_pin``,
``pin``, ``unpin``, ``pins`` (pinning.py keeps them in the index, so they
survive a restart), ``write_budget_left`` (budget.py keeps the bucket beside
the index) and ``watch`` (its writer reports what it indexes and evicts;
``remove``, ``evict_to`` and quarantines report here). It uses the tier's
``index``, ``writer``, ``max_bytes``, ``_counts`` and ``_writes``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ...blocks import Block, BlockMeta
from ...errors import PinCapacityError
from ...memory.host import tensors_of
from ..base import BlockListener
from .payload import encode_header

if TYPE_CHECKING:
    from ..writer import Writer
    from .health import Counts
    from .index import SsdIndex
    from .writes import SsdWrites


class SsdControls:
    """Pins, write budget and events of an SSD tier (mixed into ``SsdTier``)."""

    index: SsdIndex
    writer: Writer
    max_bytes: int
    _writes: SsdWrites
    _counts: Counts

    def iter_meta(self) -> Iterator[BlockMeta]: ...

    def watch(self, listener: BlockListener) -> bool:
        self._writes.listener = listener
        return True

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
        metas = {m.key: m for m in self.iter_meta()}
        parents = {m.parent for m in metas.values()}
        leaves = sorted((m for m in metas.values() if m.key not in parents), key=_newest)
        starts = [*(metas[k] for k in self.index.pins() if k in metas), *leaves]
        out: list[BlockMeta] = []
        seen: set[bytes] = set()
        total = 0
        for start in starts:
            chain, meta = [], start
            while meta is not None and meta.key not in seen:
                chain.append(meta)
                meta = metas.get(meta.parent)
            if chain and chain[-1].parent != chain[-1].root and chain[-1].parent not in seen:
                continue  # its chain is broken above: unreachable from the root
            for meta in reversed(chain):
                if total + meta.nbytes > max_bytes:
                    return out
                out.append(meta)
                seen.add(meta.key)
                total += meta.nbytes
        return out

    def write_budget_left(self) -> int | None:
        """Budget minus the bucket's level minus the bytes queued (not yet charged)."""
        budget = self._writes.write_budget
        if not budget:
            return None
        level, _ = self.index.written(budget)
        return int(budget - level) - self.writer.queue_bytes

    def control_stats(self) -> dict[str, int]:
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

    # -- blocks leaving the tier on request: reported as events too --------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks from the index and disk; returns how many were indexed."""
        removed = self.index.remove_keys(keys)
        self.report_removed(removed)
        return len(removed)

    def evict_to(self, nbytes: int) -> int:
        """Evict LRU leaves until at most ``nbytes`` are stored; returns blocks evicted."""
        evicted = self.index.evict_to(nbytes)
        self._counts.add("num_evictions", len(evicted))
        self.report_removed(evicted)
        return len(evicted)

    def report_removed(self, keys: Sequence[bytes]) -> None:
        listener = self._writes.listener
        if listener is not None and keys:
            listener.removed("ssd", keys)


def _newest(meta: BlockMeta) -> float:
    return -meta.last_used


def _file_bytes(block: Block) -> int:
    """Bytes of ``block``'s payload file: its safetensors header plus its tensors."""
    tensors = tensors_of(block.arrays)
    return len(encode_header(tensors, block.key)) + sum(t.data.nbytes for t in tensors)
