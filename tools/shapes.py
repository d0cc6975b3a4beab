"""Cache shapes of real models for the restore benchmarks: a model of the right layer
kinds and a filled cache of the right sizes, without the model's weights.

The shapes are the simulator's presets (``prefixcache.traces.shapes.PRESETS``):
``RESTORE_SHAPES`` names the ones the restore benchmarks run (``--shape all``).
A shape travels to a child process (``tools/bench_blocks.py --base-root``, which
may import an older prefixcache without these presets) as its JSON fields
(``shape_json`` / ``shape_from_json``).

The model is a tiny random-weight mlx-lm model whose ``make_cache`` gives the
shape's layer kinds in the real order: llama (every layer full attention),
gemma3_text (a window layer and a full one alternating: gpt-oss-20b's layout),
qwen3_next (three gated-delta-net layers, then an attention one). The cache is
filled with random values of the dtypes and sizes a one-token forward gives
each layer (K/V of ``kv_heads`` x ``head_dim``; a recurrent layer's conv window
and state): the model's attention has the shape's sizes, its other widths are
tiny.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from prefixcache.tiny.models import build_model
from prefixcache.traces.shapes import ModelShape

RESTORE_SHAPES = ["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-next-80b-a3b", "gpt-oss-20b"]

# the gated-delta-net layers of the Qwen3-Next preset: 16 key heads, 32 value heads
# of 128, conv kernel 4 (traces/shapes.py counts the same state)
GDN = {"k_heads": 16, "v_heads": 32, "dim": 128, "conv": 4}


def named(names: list[str]) -> list[ModelShape]:
    """The presets named (``all``: ``RESTORE_SHAPES``).

    Raises:
        ValueError: a name is not a preset.
    """
    from prefixcache.traces.shapes import PRESETS

    if names == ["all"]:
        names = RESTORE_SHAPES
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise ValueError(f"unknown shape {unknown[0]!r} (presets: {', '.join(RESTORE_SHAPES)})")
    return [PRESETS[n] for n in names]


def custom(layers: int, kv_heads: int, head_dim: int) -> ModelShape:
    """A dense shape of full-attention layers (``--layers`` etc.)."""
    name = f"{layers}x{kv_heads}x{head_dim}"
    return ModelShape(name, layers, 0, 0, kv_heads, head_dim, 0, 0, 0.0, kv_heads)


def shape_json(shape: ModelShape) -> str:
    return json.dumps(asdict(shape))


def shape_from_json(text: str) -> ModelShape:
    return ModelShape(**json.loads(text))


def num_layers(shape: ModelShape) -> int:
    return shape.full_layers + shape.window_layers + shape.recurrent_layers


def model_for(shape: ModelShape):
    """A tiny model whose ``make_cache`` has the shape's layer kinds in order, and
    whose attention (and recurrent state) has the shape's sizes."""
    layers = num_layers(shape)
    heads = {
        "num_hidden_layers": layers,
        "num_attention_heads": shape.kv_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
    }
    if shape.recurrent_layers:
        return build_model(
            "qwen3_next",
            dtype=mx.bfloat16,
            **heads,
            full_attention_interval=layers // shape.full_layers,
            num_experts=0,  # dense MLPs: bf16 runs on the CPU (MoE needs float32)
            linear_num_key_heads=GDN["k_heads"],
            linear_num_value_heads=GDN["v_heads"],
            linear_key_head_dim=GDN["dim"],
            linear_value_head_dim=GDN["dim"],
            linear_conv_kernel_dim=GDN["conv"],
        )
    if shape.window_layers:
        return build_model(
            "gemma3_text",
            dtype=mx.bfloat16,
            **heads,
            sliding_window=shape.window,
            sliding_window_pattern=layers // shape.full_layers,
        )
    return build_model("llama", dtype=mx.bfloat16, **heads)


def filled_cache(shape: ModelShape, model, num_tokens: int) -> list[Any]:
    """The model's cache holding ``num_tokens`` random tokens: each layer's arrays of
    the dtypes and sizes a one-token forward gives them."""
    probe = model.make_cache()
    mx.eval(model(mx.array([[1]]), cache=probe))
    cache = model.make_cache()
    for c, p in zip(cache, probe, strict=True):
        if type(c) in (KVCache, RotatingKVCache):
            b, heads, _, dim = p.keys.shape
            c.update_and_fetch(
                _random((b, heads, num_tokens, dim), p.keys.dtype),
                _random((b, heads, num_tokens, p.values.shape[-1]), p.values.dtype),
            )
        elif type(c) is ArraysCache:
            for i, a in enumerate(p.cache):
                c[i] = _random(a.shape, a.dtype)
        else:
            raise TypeError(f"no filler for {type(c).__name__}")
        mx.eval(c.state)
    return cache


def _random(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.random.normal(shape).astype(dtype)


def cache_bytes(cache: list[Any], num_tokens: int, block_size: int) -> int:
    """Bytes a restore of ``num_tokens`` copies: K/V of every token a layer keeps (a
    window layer: the whole blocks its window reaches) and each recurrent layer's state."""
    total = 0
    for c in cache:
        if type(c) is ArraysCache:
            total += sum(a.nbytes for a in c.cache)
            continue
        window = -(-c.max_size // block_size) * block_size if type(c) is RotatingKVCache else 0
        keep = min(num_tokens, window) if window else num_tokens
        per_token = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
        total += keep * per_token
    return total


def stored_chain(pc, shape: ModelShape, model, num_tokens: int) -> tuple[list[int], int]:
    """A cache of ``num_tokens`` random tokens shaped like ``shape`` stored in ``pc`` (a
    PrefixCache) and flushed: (the probe that fetches all of it, the bytes its restore
    copies)."""
    tokens = np.random.default_rng(0).integers(0, 512, num_tokens).tolist()
    cache = filled_cache(shape, model, num_tokens)
    pc.store(tokens, cache)
    pc.flush()
    return [*tokens, 1], cache_bytes(cache, num_tokens, pc.config.block_size)
