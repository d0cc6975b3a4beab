"""A third-party cache class plugs in through the public codec registry.

The cache here is a small TurboQuant-style one written for the test: K/V are
rotated by a seeded randomized Hadamard transform, then quantized; attention
reads them dequantized and rotated back. Its codec keeps blocks packed, so
the hot tier, the SSD tier and the restored cache hold only packed data.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import QUANT_LLAMA, max_diff, prompt
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from prefixcache import CacheConfig, MissReason, PrefixCache, UnsupportedCacheError
from prefixcache.cache.capture import chunk_ends
from prefixcache.codecs import Builder, Codec, Payload, register_codec, unregister_codec
from prefixcache.tiny.models import build_model

BLOCK = 16
PARTS = ("q", "scales", "biases")


def hadamard_rotation(dim: int, seed: int) -> mx.array:
    """(dim, dim) orthogonal: random signs times a normalised Sylvester Hadamard matrix."""
    h = np.array([[1.0]])
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], dim)
    return mx.array((signs[:, None] * h / math.sqrt(dim)).astype(np.float32))


class TurboQuantCache(_BaseCache):
    """Rotated + quantized K/V; the rotation (from ``seed``) is the cache's own state."""

    # not ``bits``: mlx-lm would take it for its QuantizedKVCache and skip update_and_fetch
    def __init__(self, head_dim: int, *, num_bits: int = 4, group_size: int = 32, seed: int = 7):
        self.num_bits, self.group_size, self.seed = num_bits, group_size, seed
        self.rotation = hadamard_rotation(head_dim, seed)
        self.keys: tuple[mx.array, ...] | None = None  # packed (q, scales, biases)
        self.values: tuple[mx.array, ...] | None = None
        self.offset = 0

    def _pack(self, x: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x @ self.rotation, group_size=self.group_size, bits=self.num_bits))

    def _append(self, old: tuple[mx.array, ...], new: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return tuple(
            mx.concatenate([o[..., : self.offset, :], n], axis=2)
            for o, n in zip(old, new, strict=True)
        )

    def _read(self, packed: tuple[mx.array, ...]) -> mx.array:
        q, scales, biases = (p[..., : self.offset, :] for p in packed)
        x = mx.dequantize(q, scales, biases, group_size=self.group_size, bits=self.num_bits)
        return x @ self.rotation.T

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        new_k, new_v = self._pack(keys), self._pack(values)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys, self.values = (
                self._append(self.keys, new_k),
                self._append(self.values, new_v),
            )
        self.offset += keys.shape[2]
        return self._read(self.keys), self._read(self.values)

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self):
        return [] if self.keys is None else [*self.keys, *self.values]

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class TurboQuantCodec(Codec):
    """Blocks are slices of the packed arrays: each token row is quantized on its own."""

    cache_type = TurboQuantCache

    def layout(self, cache: TurboQuantCache) -> tuple[object, ...]:
        _, heads, _, _ = cache.keys[0].shape
        dim = cache.rotation.shape[0]
        return ("TurboQuantCache", heads, dim, cache.num_bits, cache.group_size, cache.seed)

    def length(self, cache: TurboQuantCache) -> int:
        return cache.offset

    def cut(self, cache, start, end, *, length, snapshot=True):
        return {
            f"{name}.{part}": mx.array(arr[..., start:end, :])
            for name, packed in (("keys", cache.keys), ("values", cache.values))
            for part, arr in zip(PARTS, packed, strict=True)
        }

    def missing(self, fresh, num_tokens, block_size, payload: Payload):
        for index in range(-(-num_tokens // block_size)):
            has = payload(index)
            if has is not None and not (has("keys.q") and has("values.q")):
                return index, MissReason.LAYOUT_MISMATCH
        return None

    def builder(self, fresh, num_tokens, capacity, block_size) -> Builder:
        return TurboQuantBuilder(fresh, num_tokens, capacity, block_size)


class TurboQuantBuilder(Builder):
    """Fills preallocated packed buffers by slice assignment; never dequantizes."""

    def __init__(self, fresh: TurboQuantCache, num_tokens: int, capacity: int, block_size: int):
        self.cache, self.num_tokens = fresh, num_tokens
        self.capacity, self.block_size = capacity, block_size
        self.buffers_: dict[str, list[mx.array]] = {}

    def add(self, index: int, arrays: dict[str, mx.array]) -> None:
        start = index * self.block_size
        for name in ("keys", "values"):
            parts = [arrays[f"{name}.{p}"] for p in PARTS]
            if name not in self.buffers_:
                self.buffers_[name] = [
                    mx.zeros((*p.shape[:2], self.capacity, p.shape[-1]), p.dtype) for p in parts
                ]
            for buf, p in zip(self.buffers_[name], parts, strict=True):
                buf[..., start : start + p.shape[2], :] = p

    def buffers(self) -> list[mx.array]:
        return [b for bufs in self.buffers_.values() for b in bufs]

    def finish(self) -> TurboQuantCache:
        self.cache.keys = tuple(self.buffers_["keys"])
        self.cache.values = tuple(self.buffers_["values"])
        self.cache.offset = self.num_tokens
        return self.cache


def turbo_model():
    model = build_model("llama", seed=3, **QUANT_LLAMA)
    head_dim = QUANT_LLAMA["head_dim"]
    model.make_cache = lambda: [TurboQuantCache(head_dim) for _ in model.layers]
    return model


@pytest.fixture
def registered():
    register_codec(TurboQuantCodec())
    yield
    unregister_codec(TurboQuantCache)


def live(model, tokens, split: int) -> mx.array:
    cache = model.make_cache()
    pos, logits = 0, None
    for end in chunk_ends(0, split, BLOCK) + chunk_ends(split, len(tokens), BLOCK):
        logits = model(mx.array([tokens[pos:end]]), cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        pos = end
    return logits


@pytest.mark.parametrize("tier", ["hot", "ssd"])
def test_third_party_cache_is_stored_restored_quantized_and_exact(registered, tier, tmp_path):
    model = turbo_model()
    settings = {"hot_cache_only": True}
    if tier == "ssd":
        settings = {"hot_cache_only": False, "ssd_dir": str(tmp_path), "hot_max_bytes": 1}
    shared = prompt(1, 56)
    a, b, wrong = shared + prompt(2, 20), shared + prompt(3, 21), prompt(4, 70)
    with PrefixCache(model, CacheConfig(block_size=BLOCK, **settings), model_id="tq") as pc:
        assert pc.layout.signature[0][0] == "TurboQuantCache"
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.prefill(wrong, prefill_step_size=BLOCK)
        pc.flush()
        if tier == "hot":  # blocks hold packed data only
            dtypes = {str(x.dtype) for blk in pc.hot for x in blk.arrays.values()}
            assert dtypes == {"mlx.core.uint32", "mlx.core.float32"}
            assert all(x.shape[-1] <= 4 for blk in pc.hot for x in blk.arrays.values())
        _, logits = pc.prefill(b, prefill_step_size=BLOCK)
        assert pc.stats()["cached_tokens"] == 48
        assert max_diff(logits, live(model, b, 48)) == 0.0

        restored, num_cached = pc.fetch(b)
        assert num_cached == 64  # b's own blocks now
        for layer in restored:
            assert isinstance(layer, TurboQuantCache)
            assert layer.keys[0].dtype == mx.uint32  # still quantized
            assert layer.keys[0].shape[2] == len(b) + 256  # one preallocated buffer

        # negative control: the other prompt's packed K/V change the logits
        mine, _ = pc.fetch(b[:49])
        theirs, _ = pc.fetch(wrong[:49])
        mine[0] = theirs[0]
        swapped = model(mx.array([b[48:]]), cache=mine)[:, -1, :]
        assert max_diff(swapped, live(model, b, 48)) > 0.0


def test_unregistered_cache_class_is_refused_loudly():
    with pytest.raises(UnsupportedCacheError, match="TurboQuantCache"):
        PrefixCache(turbo_model(), CacheConfig(block_size=BLOCK, hot_cache_only=True))
