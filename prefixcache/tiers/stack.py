"""Tiers: where blocks live (hot, then ssd) and how they move between them.

The read path looks in hot, then ssd, and promotes ssd hits into hot when it
has room. The write path puts new blocks in hot; ``write_back`` spills a dirty
block to ssd when hot evicts it, ``write_through`` queues it for ssd at once.
This is the only module that reads ``hot_cache_only``: without an ssd tier an
evicted block is discarded (and remembered, to explain the next miss).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..blocks import Block, BlockMeta
from ..config import CacheConfig
from ..errors import MissReason, PayloadError
from ..host import Placed
from ..stats import Stats
from .hot import HotTier
from .ssd.payload import read_header

if TYPE_CHECKING:
    from ..restore import Place
    from .ssd.stream import StreamedBlock
    from .ssd.tier import SsdTier


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

    def chain_load(self, keys: list[bytes]) -> ChainLoad:
        """A loader for one restore of ``keys``: SSD blocks stream, read ahead."""
        return ChainLoad(self, keys)

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


class ChainLoad:
    """Loads the blocks of one restore in chain order: hot ones from hot, the
    rest streamed from SSD (ssd/stream.py: reader threads read later blocks,
    straight into their place in the restore buffers, while earlier ones are
    handled; HostArray views are valid until the next load). ``loaded``
    collects SSD blocks to promote, as MLX copies, while hot has room for them
    (and ``promote`` is on)."""

    def __init__(self, tiers: Tiers, keys: list[bytes]):
        self.tiers, self.keys = tiers, keys
        self.loaded: list[Block] = []
        self._room = tiers.hot.max_bytes - tiers.hot.nbytes if tiers.config.promote else 0
        self._stream: Iterator[Block | StreamedBlock | None] | None = None
        self._order: deque[bytes] = deque()

    def prepare(self, indices: list[int], place: Place | None = None) -> None:
        """Start reading the SSD blocks among ``indices`` (the order of the loads),
        each tensor into its ``place`` when it has one (see ssd/stream.py)."""
        self.close()
        if self.tiers.ssd is None:
            return
        from .ssd.stream import stream

        self._order = deque(self.keys[i] for i in indices if self.keys[i] not in self.tiers.hot)
        if self._order:
            self._stream = stream(self.tiers.ssd, list(self._order), place)

    def first_shapes(self, indices: list[int]) -> tuple[int, dict[str, Placed]] | None:
        """The first block among ``indices`` that will be streamed from SSD, with its
        tensors' dtypes and shapes read from its payload header (unverified: they
        only size the restore buffers, so every block, that one too, can be read
        straight into place); None if there is none or its header is unreadable."""
        ssd = self.tiers.ssd
        for i in indices if ssd is not None else ():
            key = self.keys[i]
            if key in self.tiers.hot:
                continue
            if ssd.writer.pending(key) is not None:
                return None
            try:
                specs = read_header(ssd.payload_file(key), key)
            except (OSError, PayloadError):
                return None  # the stream reads it again and tells
            return i, {name: Placed((), dtype, shape) for name, dtype, shape in specs}
        return None

    def load(self, index: int) -> tuple[Block | StreamedBlock | None, bool]:
        """(block, whether it is hot); (None, False) if unusable."""
        key = self.keys[index]
        if self._stream is None or not self._order or self._order[0] != key:
            block, hot = self.tiers.load(key)  # unplanned: one synchronous load
        else:
            self._order.popleft()
            block, hot = next(self._stream), False
            if block is not None:
                self.tiers.stats.ssd_block_hits += 1
        if block is not None and not hot and block.nbytes <= self._room:
            self._room -= block.nbytes
            self.loaded.append(block if isinstance(block, Block) else block.to_block())
        return block, hot

    def close(self) -> None:
        """Stop the stream and wait for its readers; safe to call more than once."""
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]
            self._stream = None


def _build_ssd(config: CacheConfig) -> SsdTier | None:
    """The SSD tier, or None: the only place ``hot_cache_only`` is read."""
    if config.hot_cache_only:
        return None
    from .ssd.tier import SsdTier

    return SsdTier(
        config.ssd_path,
        max_bytes=config.ssd_max_bytes,
        min_free_bytes=config.ssd_min_free_bytes,
        queue_bytes=config.write_queue_bytes,
        queue_full=config.queue_full,
    )
