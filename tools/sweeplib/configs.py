"""Tiny configs for every ``mlx_lm.models`` module, read off its ``ModelArgs``.

mlx-lm's ``BaseModelArgs.from_dict`` keeps only the keys its dataclass names,
so one dict of small values under the usual config names (``SMALL``) serves
most modules, nested as ``text_config`` too. A field with no default that
``SMALL`` does not name gets a value from its type; ``OVERRIDES`` fixes the
modules whose configs need more (layer patterns, ratios between sizes).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from typing import Any

import mlx_lm.models

from .overrides import OVERRIDES
from .sizes import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB

SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "hidden_dim": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "dim": HIDDEN,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "n_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 4096,
    "n_positions": 4096,
    "n_ctx": 4096,
    "model_max_length": 4096,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    # mixture of experts: 4 small experts, 2 per token, every layer sparse
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 32,
    # windows (16 tokens: a 96-token shared prefix wraps them)
    "sliding_window": 16,
    "sliding_window_size": 16,
    "attention_window_size": 16,
    "sliding_window_pattern": 2,
    "attention_chunk_size": 32,
    # recurrent layers
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "conv_kernel": 4,
    "conv_L_cache": 3,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_num_heads": 4,
    "mamba_n_heads": 4,
    "mamba_head_dim": 32,
    "mamba_d_head": 16,
    "mamba_d_ssm": 64,
    "time_step_rank": "auto",
    "time_step_limit": [0.0, 100.0],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
}


def modules() -> list[str]:
    """Every ``mlx_lm.models`` module name (whether or not it defines a model)."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def has_model(module: str) -> bool:
    """Whether ``module``'s source defines ``ModelArgs`` and ``Model`` (read, not
    imported: some modules exit on import when an optional package is missing)."""
    path = os.path.join(mlx_lm.models.__path__[0], f"{module}.py")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return "class ModelArgs" in source and "class Model(" in source


def by_type(field: dataclasses.Field, module: str) -> Any:
    """A value for a required field ``SMALL`` does not name, from its annotation."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    kind = str(kind)
    if field.name == "model_type":
        return module
    if kind.startswith("bool"):
        return False
    if kind.startswith("int"):
        return 1
    if kind.startswith("float"):
        return 1.0
    if kind.startswith("str"):
        return ""
    if "dict" in kind.lower():
        return {}
    if "list" in kind.lower() or "tuple" in kind.lower():
        return []
    return None


def config_for(module: str, args: type) -> dict[str, Any]:
    """The tiny config of ``module`` whose ``ModelArgs`` is ``args``."""
    config = {"model_type": module, **SMALL}
    fields = dataclasses.fields(args) if dataclasses.is_dataclass(args) else ()
    for field in fields:
        if field.name in config:
            continue
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            config[field.name] = by_type(field, module)
    if any(f.name == "text_config" for f in fields):
        config["text_config"] = {**SMALL, "model_type": module}
    for key, value in OVERRIDES.get(module, {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def load(module: str) -> Any | None:
    """The module when it defines ``ModelArgs`` and ``Model``, else None.

    Raises:
        ImportError (or the module's own error): it cannot be imported here.
    """
    try:
        mod = importlib.import_module(f"mlx_lm.models.{module}")
    except SystemExit as err:  # a module that exits when an optional package is missing
        raise ImportError(f"mlx_lm.models.{module} exited on import: {err}") from err
    if not (hasattr(mod, "ModelArgs") and hasattr(mod, "Model")):
        return None
    return mod
