"""Simulate a trace through the library's own tier policies, on payload-less blocks.

Each request of a trace is a chain of blocks (one per hash id, keyed by its
place in the trie of all prompts, so that equal ids under equal prefixes are
one block). A block holds no arrays, only its byte size from a model shape.
The hot tier is the library's :class:`HotTier` (its eviction: ``lru``,
``cost``, ``density`` or ``frequency``, leaves first, snapshots shed first); blocks it evicts
spill to the SSD tier through the library's :class:`WriteGovernor`
(``ssd_admit_after``, the write budget as a leaky bucket on the trace's clock)
and then to the remote tier. The SSD and remote tiers are byte-bounded,
leaves-first LRUs (the same class, as the SSD tier's index keeps them).

Per request: the longest prefix held across the tiers is the hit (for a shape
with recurrent state, cut back to the deepest block holding a checkpoint: a
request's last full block keeps one, and its short last block is not stored,
since without its state it resumes nothing; a prompt ending at a block hot holds
without its state upgrades it, as a capture does), hits below hot are promoted into hot, the
rest of the chain is stored (its sightings count twice when it continues a
chain from its end, as the library's stack counts a next turn). Token counts
follow the trace: the last block of a request may be short.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from ..blocks import Block
from ..config import DEFAULT_EVICTION, CacheConfig
from ..stats import Stats
from ..tiers.governor import WriteGovernor
from ..tiers.hot.tier import HotTier
from ..tiers.pins import Pins
from .lower import DAY_SECONDS, LowerTier, MeteredTier
from .reader import TRACE_BLOCK_TOKENS, TraceRequest
from .shapes import ModelShape

TIERS = ("hot", "ssd", "remote")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One configuration: budgets in bytes (None: the tier is absent; 0 with
    ``unlimited``: unbounded), the hot tier's eviction (the library's default:
    ``DEFAULT_EVICTION``) and the SSD's admission."""

    shape: ModelShape
    hot_bytes: int | None
    ssd_bytes: int | None = None
    remote_bytes: int | None = None
    eviction: str = DEFAULT_EVICTION
    ssd_admit_after: int = 1
    ssd_write_budget: int = 0
    block_tokens: int = TRACE_BLOCK_TOKENS


@dataclass(slots=True)
class SimResult:
    """What a simulation counted (``as_json``: the report's keys)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_half_prompt: int = 0
    last_half_cached: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ssd_bytes_written: int = 0
    trace_seconds: float = 0.0
    prefill_flops_saved: float = 0.0
    seconds: float = 0.0

    def as_json(self) -> dict[str, object]:
        cached = max(1, self.cached_tokens)
        days = max(self.trace_seconds, 1.0) / DAY_SECONDS
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
            "hit_rate_last_half": self.last_half_cached / max(1, self.last_half_prompt),
            "hit_share": {t: n / cached for t, n in self.hit_tokens.items()},
            "ssd_bytes_written": self.ssd_bytes_written,
            "ssd_bytes_written_per_day": self.ssd_bytes_written / days,
            "peak_bytes": dict(self.peak_bytes),
            "prefill_flops_saved": self.prefill_flops_saved,
            "trace_seconds": self.trace_seconds,
            "seconds": self.seconds,
        }


class Simulation:
    """One configuration run over a trace; :meth:`run` returns the counts."""

    def __init__(self, config: SimConfig):
        self.config = config
        shape = config.shape
        self.checkpoint = shape.checkpoint_bytes
        stats, pins = Stats(), Pins()
        huge = 1 << 62
        hot_bytes = config.hot_bytes if config.hot_bytes is not None else 0
        self.hot = HotTier(
            hot_bytes or (huge if config.hot_bytes == 0 else 0),
            self._on_hot_evict,
            self._shed if self.checkpoint else None,
            pins,
            self._cost if config.eviction in ("cost", "adaptive") else None,
            policy=config.eviction,
        )
        self.lower: list[LowerTier] = []
        if config.ssd_bytes is not None:
            self.lower.append(
                MeteredTier("ssd", config.ssd_bytes or huge, write_budget=config.ssd_write_budget)
            )
        if config.remote_bytes is not None:
            self.lower.append(LowerTier("remote", config.remote_bytes or huge))
        governed = CacheConfig(
            hot_cache_only=True,
            ssd_admit_after=config.ssd_admit_after,
            ssd_write_budget=config.ssd_write_budget,
            ssd_max_bytes=config.ssd_bytes or huge,
        )
        self.governor = WriteGovernor(governed, stats, pins, self.hot)
        self.result = SimResult()
        self._edges: dict[tuple[bytes, int], Block] = {}
        self._kv: dict[bytes, int] = {}  # key -> bytes without a checkpoint

    def _cost(self, block: Block) -> float:
        start = block.index * self.config.block_tokens
        return self.config.shape.prefill_flops(start, self.config.block_tokens)

    def _shed(self, block: Block) -> Block | None:
        kv = self._kv[block.key]
        if block.nbytes == kv:
            return None
        return Block(block.key, block.parent, block.root, block.index, b"", {}, kv)

    def _on_hot_evict(self, block: Block, dirty: bool) -> None:
        if not dirty:
            return
        for tier in self.lower:
            self.governor.put(tier, block, last_chance=True)

    def chain(self, request: TraceRequest) -> tuple[list[Block], list[int]]:
        """The request's blocks (payload-less; the last with a checkpoint) and tokens."""
        tokens = request.block_tokens(self.config.block_tokens)
        parent, blocks = b"\0" * 16, []
        for index, (block_id, n) in enumerate(zip(request.hash_ids, tokens, strict=True)):
            block = self._edges.get((parent, block_id))
            if block is None:
                key = xxhash.xxh3_128_digest(parent + block_id.to_bytes(8, "little"))
                kv = self.config.shape.block_bytes(n)
                block = Block(key, parent, b"\0" * 16, index, b"", {}, kv)
                self._edges[(parent, block_id)] = block
                self._kv[key] = kv
            blocks.append(block)
            parent = block.key
        if self.checkpoint and blocks:
            if tokens[-1] < self.config.block_tokens:
                blocks = blocks[:-1]  # a short block without its state resumes nothing
            if blocks:  # the state at the last full block: where a next turn resumes
                b = blocks[-1]
                nbytes = self._kv[b.key] + self.checkpoint
                blocks[-1] = Block(b.key, b.parent, b.root, b.index, b"", {}, nbytes)
        return blocks, tokens

    def run(self, requests: Sequence[TraceRequest]) -> SimResult:
        """Every request in order; the last half is kvcache-simulator's window."""
        began = time.perf_counter()
        result = self.result
        first = requests[0].timestamp_ms if requests else 0
        half = len(requests) // 2
        for i, request in enumerate(requests):
            now = (request.timestamp_ms - first) / 1000.0
            for tier in self.lower:
                tier.now = now
            self.step(request, measured=i >= half)
            result.peak_bytes["hot"] = max(result.peak_bytes["hot"], self.hot.nbytes)
            for tier in self.lower:
                result.peak_bytes[tier.name] = max(result.peak_bytes[tier.name], tier.lru.nbytes)
        result.trace_seconds = (requests[-1].timestamp_ms - first) / 1000.0 if requests else 0.0
        result.ssd_bytes_written = sum(
            t.bytes_written for t in self.lower if isinstance(t, MeteredTier)
        )
        result.seconds = time.perf_counter() - began
        return result

    def _held(self, blocks: list[Block]) -> list[tuple[str, Block]]:
        """(tier, block held there) for the longest prefix some tier holds."""
        out = []
        for block in blocks:
            held = self.hot.get(block.key)
            name = "hot"
            for tier in self.lower:
                if held is not None:
                    break
                held, name = tier.lru.get(block.key), tier.name
            if held is None:
                break
            out.append((name, held))
        if self.checkpoint:  # resume only where recurrent state was kept
            while out and out[-1][1].nbytes <= self._kv[out[-1][1].key]:
                out.pop()
        return out

    def step(self, request: TraceRequest, *, measured: bool) -> None:
        """Fetch (count the hit, touch, promote), then store the rest of the chain."""
        blocks, tokens = self.chain(request)
        found = self._held(blocks)
        cached = sum(tokens[: len(found)])
        result = self.result
        result.requests += 1
        result.prompt_tokens += sum(tokens)
        result.cached_tokens += cached
        if measured:
            result.last_half_prompt += sum(tokens)
            result.last_half_cached += cached
        start = 0
        for (name, _), n in zip(found, tokens, strict=False):
            result.hit_tokens[name] += n
            result.prefill_flops_saved += self.config.shape.prefill_flops(start, n)
            start += n
        for tier in self.lower:
            tier.touch([b.key for name, b in found if name == tier.name])
        self.hot.touch([b.key for name, b in found if name == "hot"])
        for name, block in found:
            self.governor.seen(block.key)
            if name != "hot":
                self._put_hot(block, dirty=False)
        new = blocks[len(found) :]
        uses = 2 if self._continues(found, new) else 1
        for block in new:
            self.governor.seen(block.key, uses)
            self._put_hot(block, dirty=True)

    def _continues(self, found: list[tuple[str, Block]], new: list[Block]) -> bool:
        """Whether ``new`` continues a chain from its end, as ``TierStack.continues``
        asks (a conversation's next turn): its sightings count twice."""
        if self.governor.sightings is None or not found or not new:
            return False
        parent, keys = found[-1][1].key, {b.key for b in new}
        tiers = [self.hot, *(t.lru for t in self.lower)]
        return not any(c.key not in keys for t in tiers for c in t.children(parent))

    def _put_hot(self, block: Block, *, dirty: bool) -> None:
        held = self.hot.get(block.key)
        if dirty and held is not None and block.nbytes > held.nbytes:
            # a prompt ending at a block hot holds without its state: the capture's
            # upgrade (TierStack.replace) swaps in the block with it, in every tier
            self.hot.remove([block.key])
            for tier in self.lower:
                tier.remove([block.key])
        cold = block.index > 0 and block.parent not in self.hot
        if not self.hot.put(block, dirty=dirty, at_cold_end=cold) and dirty:
            self._on_hot_evict(block, True)  # refused or larger than hot: spilled
