"""Tiers: where blocks live (hot, then ssd) and how they move between them.

The read path looks in hot, then ssd, and promotes ssd hits into hot when it
has room. The write path puts new blocks in hot; ``write_back`` spills a dirty
block to ssd when hot evicts it, ``write_through`` queues it for ssd at once.
This is the only module that reads ``hot_cache_only``: without an ssd tier an
evicted block is discarded (and remembered, to explain the next miss).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .blocks import Block, BlockMeta
from .config import CacheConfig
from .hot import HotTier
from .stats import MissReason, Stats

if TYPE_CHECKING:
    from .ssd import SsdTier

_EVICTED_MEMORY = 65536  # keys remembered to tell "evicted" from "never stored"


class Tiers:
    """The hot tier and the optional ssd tier of one PrefixCache (not thread-safe)."""

    def __init__(self, config: CacheConfig, stats: Stats):
        self.config = config
        self.stats = stats
        self.hot = HotTier(config.hot_max_bytes, on_evict=self._on_hot_evict)
        self.ssd = _build_ssd(config)
        self._evicted: deque[bytes] = deque(maxlen=_EVICTED_MEMORY)
        self._evicted_set: set[bytes] = set()

    # -- read path -----------------------------------------------------------

    def lookup(self, key: bytes) -> Block | BlockMeta | None:
        """The block (hot) or its index entry (ssd, or queued for it), without payload."""
        block = self.hot.get(key)
        if block is not None:
            return block
        return self.ssd.get_meta(key) if self.ssd is not None else None

    def contains(self, key: bytes) -> bool:
        return key in self.hot or (self.ssd is not None and self.ssd.contains(key))

    def missing_reason(self, key: bytes) -> MissReason:
        return MissReason.EVICTED if key in self._evicted_set else MissReason.NO_PREFIX

    def load(self, key: bytes) -> tuple[Block | None, bool]:
        """(block with payload, whether it is hot); (None, False) if unusable."""
        block = self.hot.get(key)
        if block is not None:
            self.stats.hot_block_hits += 1
            return block, True
        block = self.ssd.load(key) if self.ssd is not None else None
        if block is not None:
            self.stats.ssd_block_hits += 1
        return block, False

    def after_hit(self, chain: list[bytes], loaded: list[Block]) -> None:
        """Promote ssd blocks into hot while it has room; mark the chain used."""
        if self.config.promote:
            for block in sorted(loaded, key=lambda b: b.index):
                if self.hot.nbytes + block.nbytes <= self.hot.max_bytes and self.hot.put(block):
                    self.stats.num_promotions += 1
        self.hot.touch(chain)
        if self.ssd is not None:
            self.ssd.touch([k for k in chain if k not in self.hot])

    # -- write path ----------------------------------------------------------

    def keep(self, blocks: list[Block]) -> None:
        """Place new blocks (root-first) according to the write policy."""
        write_through = self.ssd is not None and self.config.write_policy == "write_through"
        dirty = self.ssd is not None and not write_through
        warm = []
        for block in blocks:
            self.stats.stored_blocks += 1
            self.stats.stored_bytes += block.nbytes
            self._evicted_set.discard(block.key)
            if write_through:
                self.spill(block)
            cold = block.parent != block.root and block.parent not in self.hot
            if cold and self.ssd is None:  # its parent is gone: no fetch can reach it
                self._on_hot_evict(block, False)
                continue
            if not self.hot.put(block, dirty=dirty, cold=cold) and dirty:
                self.spill(block)  # larger than the whole hot budget
            if not cold:
                warm.append(block.key)
        self.hot.touch(warm)  # ancestors end up more recent than descendants

    def replace(self, blocks: list[Block]) -> None:
        """Swap stored blocks for fuller versions a later capture cut."""
        on_ssd = [b.key for b in blocks if self.ssd is not None and self.ssd.contains(b.key)]
        if on_ssd:  # those copies lack the new payloads; a queued one must land first
            self.ssd.flush()
            self.ssd.remove(on_ssd)
        for block in blocks:
            self.hot.pop(block.key)
        num_stored, nbytes = self.stats.stored_blocks, self.stats.stored_bytes
        self.keep(blocks)
        self.stats.stored_blocks, self.stats.stored_bytes = num_stored, nbytes
        self.stats.upgraded_blocks += len(blocks)

    def spill(self, block: Block) -> None:
        if self.ssd is not None and self.ssd.put(block):
            self.stats.num_spills += 1

    def flush(self) -> None:
        """Persist every dirty hot block and wait for the writer."""
        if self.ssd is None:
            return
        for block in self.hot.take_dirty():
            self.spill(block)
        self.ssd.flush()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.ssd is not None:
                self.ssd.close()

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = {
            "hot": {
                "num_blocks": len(self.hot),
                "nbytes": self.hot.nbytes,
                "max_bytes": self.hot.max_bytes,
                "num_evictions": self.hot.num_evictions,
            }
        }
        if self.ssd is not None:
            out["ssd"] = self.ssd.stats()
        return out

    def _on_hot_evict(self, block: Block, dirty: bool) -> None:
        if dirty and self.ssd is not None:
            self.spill(block)
        elif self.ssd is None:
            self.stats.num_discarded += 1
            if len(self._evicted) == self._evicted.maxlen:
                self._evicted_set.discard(self._evicted[0])
            self._evicted.append(block.key)
            self._evicted_set.add(block.key)


def _build_ssd(config: CacheConfig) -> SsdTier | None:
    """The SSD tier, or None: the only place ``hot_cache_only`` is read."""
    if config.hot_cache_only:
        return None
    from .ssd import SsdTier

    return SsdTier(
        config.ssd_path,
        max_bytes=config.ssd_max_bytes,
        min_free_bytes=config.ssd_min_free_bytes,
        queue_bytes=config.write_queue_bytes,
        queue_full=config.queue_full,
    )
