"""Model shapes for simulation: bytes a block holds and FLOPs it saves, without weights.

A shape gives, per token, the K/V bytes of its full-attention layers; per
block, the K/V of its sliding-window layers (at most the window's tokens) and,
for recurrent layers, the state a checkpoint holds (a block can only be
resumed from where a checkpoint was kept). Presets for models people run on
MLX (``PRESETS``), or a Hugging Face ``config.json`` (:func:`shape_from_config`).
``kv_bits`` quantizes K/V (with a scale and a bias per group of 64, as
mlx-lm's QuantizedKVCache) or, at 32, keeps it in float32 (a model run in
float32, as the tiny test models are); recurrent state stays at
``state_bytes_per_value``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

KV_GROUP = 64


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model's cache holds, per token and per checkpoint.

    Attributes:
        name: preset name or the config's path.
        full_layers: attention layers over the whole context.
        window_layers: sliding-window attention layers.
        window: their window in tokens (0: none).
        kv_heads: K/V heads per attention layer.
        head_dim: dimension of a head.
        recurrent_layers: layers with recurrent state (linear attention, SSM).
        state_values: values of one recurrent layer's state (conv + recurrent).
        active_params: parameters a token goes through (2 FLOPs each).
        q_heads: query heads (attention FLOPs per context token).
        kv_bits: K/V bits (16: bf16; 32: float32; 4 or 8: quantized).
        state_bytes_per_value: bytes of a recurrent state value.
    """

    name: str
    full_layers: int
    window_layers: int
    window: int
    kv_heads: int
    head_dim: int
    recurrent_layers: int
    state_values: int
    active_params: float
    q_heads: int
    kv_bits: int = 16
    state_bytes_per_value: int = 2

    def with_kv_bits(self, bits: int) -> ModelShape:
        if bits not in (4, 8, 16, 32):
            raise ValueError(f"kv_bits must be 4, 8, 16 or 32, got {bits!r}")
        return replace(self, kv_bits=bits)

    def _kv_bytes(self, tokens: int, layers: int) -> int:
        values = 2 * layers * self.kv_heads * self.head_dim * tokens
        if self.kv_bits >= 16:
            return values * self.kv_bits // 8
        return values * self.kv_bits // 8 + 2 * 2 * (values // KV_GROUP)  # bf16 scale + bias

    def block_bytes(self, num_tokens: int) -> int:
        """K/V bytes of a block of ``num_tokens`` (window layers: at most the window)."""
        window = min(num_tokens, self.window) if self.window_layers else 0
        return self._kv_bytes(num_tokens, self.full_layers) + self._kv_bytes(
            window, self.window_layers
        )

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the recurrent state a checkpoint keeps (0: any block resumes)."""
        return self.recurrent_layers * self.state_values * self.state_bytes_per_value

    def prefill_flops(self, start: int, num_tokens: int) -> float:
        """FLOPs to prefill tokens ``[start, start + num_tokens)`` after the ones before."""
        per_context = 4.0 * self.q_heads * self.head_dim
        full = num_tokens * (start + (num_tokens - 1) / 2)
        windowed = num_tokens * min(self.window, start + (num_tokens - 1) / 2)
        return (
            2.0 * self.active_params * num_tokens
            + per_context * self.full_layers * full
            + per_context * self.window_layers * windowed
        )


def _gdn_state(k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv: int) -> int:
    """Values of a gated-delta-net layer's state: recurrent matrix + conv window."""
    return v_heads * k_dim * v_dim + (conv - 1) * (2 * k_heads * k_dim + v_heads * v_dim)


PRESETS: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 0, 0, 8, 64, 0, 0, 1.24e9, 32),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 0, 0, 8, 128, 0, 0, 8.0e9, 32),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", 28, 0, 0, 8, 128, 0, 0, 0.6e9, 16),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 0, 0, 4, 128, 0, 0, 3.3e9, 32),
    # Qwen3-Next-80B-A3B: 12 full-attention layers, 36 gated-delta-net layers
    "qwen3-next-80b-a3b": ModelShape(
        "qwen3-next-80b-a3b", 12, 0, 0, 2, 256, 36, _gdn_state(16, 32, 128, 128, 4), 3.0e9, 16
    ),
    # gpt-oss-20b: 24 layers alternating full attention and a 128-token window
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 12, 12, 128, 8, 64, 0, 0, 3.6e9, 64),
}


def shape_named(name: str) -> ModelShape:
    """A preset by name, or the shape of the ``config.json`` at ``name`` (a file or folder).

    Raises:
        ValueError: no preset of that name and no readable config there.
    """
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown shape {name!r} (presets: {', '.join(PRESETS)}, or a config.json)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read shape from {str(path)!r}: {err}") from None
    return shape_from_config(config, str(path))


def shape_from_config(config: dict, name: str) -> ModelShape:
    """The shape of a dense or sliding-window transformer from its config.json fields."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{name}: config lacks {err} (num_hidden_layers, ...)") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    window = int(config.get("sliding_window") or 0)
    kinds = config.get("layer_types") or []
    num_window = sum(1 for k in kinds if k == "sliding_attention") if window else 0
    inter = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config.get("vocab_size") or 0)
    params = layers * (4 * hidden * hidden + 3 * hidden * inter) + vocab * hidden
    dtype = config.get("torch_dtype") or config.get("dtype")
    return ModelShape(
        name,
        layers - num_window,
        num_window,
        window,
        kv_heads,
        head_dim,
        0,
        0,
        float(params),
        heads,
        32 if dtype == "float32" else 16,
    )
