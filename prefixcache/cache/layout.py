"""ModelLayout: a model's cache layout, read once, to validate and rebuild caches.

The layout (cache class per layer with its dtype, heads, dims, window...) is
read from a one-token probe cache, so it names what the model really makes.
It is part of the namespace: blocks of another layout are never served.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..blocks import Block
from ..codecs import Codec, UnusedKVCache, codec_for
from ..config import CacheConfig
from ..errors import LayoutMismatchError, MissReason
from ..tiers.run_length import RunHints
from .costs import RecomputeCost
from .points import RestorePoints
from .window import WindowPolicy, window_tokens, windows


class ModelLayout:
    """Per-layer codecs and signatures of one model under one config.

    Raises:
        UnsupportedCacheError: a layer's cache type has no codec.
    """

    def __init__(self, model: nn.Module, config: CacheConfig):
        self.model = model
        self.config = config
        probe = make_prompt_cache(model)
        model(mx.array([[0]]), cache=probe)
        mx.eval([c.state for c in probe])
        self.codecs: list[Codec] = [codec_for(c) for c in probe]
        self.signature = tuple(codec.layout(c) for codec, c in zip(self.codecs, probe, strict=True))
        self.template = make_prompt_cache(model)  # read-only: classes and settings
        # layers no forward writes (no-op attention): rebuilt empty, from no block
        self.unused = tuple(i for i, c in enumerate(probe) if type(c) is KVCache and c.empty())
        self.recompute = RecomputeCost.of(model, probe)
        self.state_bytes, self.kv_token_bytes, self.window_token_bytes = _sizes(probe)
        self.state_prefixes = _state_prefixes(probe, "")
        self.window_prefixes = tuple(p for p, _, _ in windows(probe))
        self.window_sizes = tuple(w + k for _, w, k in windows(probe))
        self.window, self.window_keep = window_tokens(probe)
        # window layers whose K/V a restore takes from its last block only
        sizes = zip(self.window_prefixes, self.window_sizes, strict=True)
        self.whole_windows = tuple(p for p, size in sizes if size <= config.block_size)
        # and the blocks the widest longer one needs at a chain's end (after its front)
        longer = [(p, w) for p, w, k in windows(probe) if w + k > config.block_size]
        ends = -(-max(w for _, w in longer) // config.block_size) if longer else 0
        self.run_hints = RunHints(self.whole_windows, ends, tuple(p for p, _ in longer))
        cfg = config
        self.kv_quant = (
            (cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start) if cfg.kv_bits else None
        )

    def __len__(self) -> int:
        return len(self.signature)

    @functools.cached_property
    def groups(self) -> tuple[tuple[str, int | None], ...]:
        """The cache groups as vLLM's KV events name them: one per kind of layer,
        ``(kv_cache_spec_kind, sliding window or None)``, in layer order."""
        out: list[tuple[str, int | None]] = []
        for cache in self.template:
            group = _group(cache)
            if group not in out:
                out.append(group)
        return tuple(out)

    @property
    def checkpointed(self) -> bool:
        """Whether some layer cannot be cut back to any earlier token: recurrent
        state (kept only where it was taken), or a window or chunk's K/V (kept
        only around restore points, window.py). Such layouts need checkpoints
        where prompts will resume (``PrefixCache.checkpoints``)."""
        return bool(self.state_prefixes or self.window_prefixes)

    def fits_window(self, num_tokens: int) -> bool:
        """Whether every window and chunk holds ``num_tokens`` whole (none wrapped yet)."""
        return all(num_tokens <= size for size in self.window_sizes)

    def missing(
        self, num_tokens: int, payload: Callable[[int], Container[str] | None]
    ) -> MissReason | None:
        """Why a restore of ``num_tokens`` from blocks whose payload names are
        ``payload(index)`` (None: unknown) cannot serve every layer, or None."""
        bs = self.config.block_size
        for layer, (codec, fresh) in enumerate(zip(self.codecs, self.template, strict=True)):
            prefix = f"{layer}."

            def has(index: int, prefix: str = prefix):
                names = payload(index)
                return None if names is None else (lambda name: prefix + name in names)

            gap = codec.missing(fresh, num_tokens, bs, has)
            if gap is not None:
                return gap[1]
        return None

    @property
    def snapshot_interval(self) -> int:
        """Blocks between restore points: recurrent-state snapshots, and the
        sliding windows kept around them (window.py).

        ``config.snapshot_interval`` when set; else the fewest blocks whose
        full-attention K/V bytes times ``snapshot_ratio`` reach what one point
        keeps (a snapshot, and the window layers' blocks it needs), so interval
        points cost at most that multiple of the K/V they sit on.
        """
        cfg = self.config
        if cfg.snapshot_interval or not self.kv_token_bytes:
            return cfg.snapshot_interval or 1
        kv_block = self.kv_token_bytes * cfg.block_size
        if cfg.kv_bits:  # packed bits, plus a scale and a bias per group (fp16-sized)
            kv_block = kv_block * (cfg.kv_bits / 16 + 2 / cfg.kv_group_size)
        # a point keeps the blocks holding the window of restores in its last block
        window = (self.window // cfg.block_size + 1) * cfg.block_size if self.window else 0
        point = self.state_bytes + self.window_token_bytes * window
        return max(1, math.ceil(point / (cfg.snapshot_ratio * kv_block)))

    @functools.cached_property
    def restore_points(self) -> RestorePoints:
        """The restore points: every ``snapshot_interval``-th boundary, and the early
        ones below it when the interval comes from the snapshot budget (points.py)."""
        interval = self.snapshot_interval
        return RestorePoints(interval, early=not self.config.snapshot_interval)

    @functools.cached_property
    def window_policy(self) -> WindowPolicy | None:
        """Which blocks keep the window layers' K/V (None: no window layer)."""
        if not self.window_prefixes:
            return None
        bs = self.config.block_size
        return WindowPolicy(
            self.window_prefixes, self.window, self.window_keep, bs, self.restore_points
        )

    def without_state(self, block: Block) -> Block | None:
        """``block`` without its recurrent-state snapshot (None: it has none)."""
        prefixes = self.state_prefixes
        lean = {n: a for n, a in block.arrays.items() if not n.startswith(prefixes)}
        if len(lean) == len(block.arrays):
            return None
        b = block
        return Block.make(b.key, b.parent, b.root, b.index, b.tokens, lean, b.tenant, b.run)

    def block_cost(self, block: Block) -> float:
        """FLOPs to prefill ``block``'s tokens again after those before it."""
        return self.recompute.flops(block.index * self.config.block_size, block.num_tokens)

    def fresh(self, num_tokens: int) -> list[Any]:
        """Empty caches for the model, quantized where mlx-lm would have quantized."""
        cfg = self.config
        fresh = make_prompt_cache(self.model)
        if cfg.kv_bits is not None and num_tokens >= cfg.quantized_kv_start:
            for i, c in enumerate(fresh):
                if type(c) is KVCache:
                    fresh[i] = QuantizedKVCache(group_size=cfg.kv_group_size, bits=cfg.kv_bits)
        for i in self.unused:
            fresh[i] = UnusedKVCache()
        return fresh

    def trimmable_at(self, num_tokens: int) -> bool:
        """Whether a rebuilt cache holding ``num_tokens`` can be trimmed by one token."""
        return all(
            codec.trimmable_at(c, num_tokens)
            for codec, c in zip(self.codecs, self.template, strict=True)
        )

    @property
    def keeps_state(self) -> bool:
        """Whether a layer holds recurrent state (no length of it can be trimmed, so
        the state at a sequence's end belongs to that exact end)."""
        return not self.trimmable_at(1)

    def validate(self, cache: Sequence[Any], num_tokens: int) -> None:
        """Refuse a cache that does not fit this layout or does not hold ``num_tokens``.

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: layers, classes, dtypes, shapes or quantization differ.
            ValueError: a layer holds another number of tokens.
        """
        if len(cache) != len(self.signature):
            raise LayoutMismatchError(
                f"cache has {len(cache)} layers, the model has {len(self.signature)}"
            )
        for i, (layer, expected) in enumerate(zip(cache, self.signature, strict=True)):
            codec = codec_for(layer)
            length = codec.length(layer)
            if length is not None and length != num_tokens:
                raise ValueError(
                    f"cache layer {i} holds {length} tokens but {num_tokens} tokens were given"
                )
            if num_tokens == 0:
                continue
            self._check_quantized(i, layer)
            got = codec.layout(layer)
            if got != expected:
                raise LayoutMismatchError(f"layer {i} layout {got} != this model's {expected}")

    def _check_quantized(self, i: int, layer: Any) -> None:
        cfg = self.config
        if not isinstance(layer, QuantizedKVCache):
            return
        if (layer.bits, layer.group_size) != (cfg.kv_bits, cfg.kv_group_size):
            raise LayoutMismatchError(
                f"layer {i} is quantized with bits={layer.bits} group_size={layer.group_size}; "
                f"this PrefixCache has kv_bits={cfg.kv_bits} kv_group_size={cfg.kv_group_size}"
            )


def _group(cache: Any) -> tuple[str, int | None]:
    """vLLM's ``KVCacheSpecKind`` of a layer's cache, and its window."""
    if isinstance(cache, RotatingKVCache):
        return "sliding_window", cache.max_size
    if isinstance(cache, ChunkedKVCache):
        return "chunked_local_attention", cache.chunk_size
    if isinstance(cache, ArraysCache):
        return "mamba", None
    if isinstance(cache, KVCache | QuantizedKVCache):
        return "full_attention", None
    return "unknown", None


def _sizes(caches: Sequence[Any]) -> tuple[int, int, int]:
    """(bytes of one recurrent-state snapshot, full-attention K/V bytes per token,
    sliding-window and chunked K/V bytes per token) of a probe."""
    state = kv = window = 0
    for cache in caches:
        if isinstance(cache, CacheList):
            sub = _sizes(cache.caches)
            state, kv, window = state + sub[0], kv + sub[1], window + sub[2]
        elif isinstance(cache, ArraysCache):
            state += sum(a.nbytes for a in cache.cache if a is not None)
        elif (
            isinstance(cache, KVCache | RotatingKVCache | ChunkedKVCache) and cache.keys is not None
        ):
            k, v = cache.keys, cache.values
            size = (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.dtype.size
            if isinstance(cache, RotatingKVCache | ChunkedKVCache):
                window += size
            else:
                kv += size
    return state, kv, window


def _state_prefixes(caches: Sequence[Any], prefix: str) -> tuple[str, ...]:
    """Payload-name prefixes of the recurrent-state layers (``"{layer}."``; nested
    in a CacheList ``"{layer}.{part}."``)."""
    out: list[str] = []
    for i, cache in enumerate(caches):
        if isinstance(cache, CacheList):
            out += _state_prefixes(cache.caches, f"{prefix}{i}.")
        elif isinstance(cache, ArraysCache):
            out.append(f"{prefix}{i}.")
    return tuple(out)
