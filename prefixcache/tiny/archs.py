"""The tiny model presets: one small mlx-lm config per architecture, by cache type.

Each preset (a key of ``ARCHS``, also the ``mlx_lm.models`` module name) is a
config dict small enough to run on a CPU in tests (hidden 64, 2-4 layers, a
512-token vocabulary) that still builds every cache type mlx-lm has: KVCache,
RotatingKVCache, ChunkedKVCache, ArraysCache, CacheList, and a model's own
cache class (deepseek_v41's LayerCache).
"""

from __future__ import annotations

from typing import Any

VOCAB_SIZE = 512

# Shared by the attention presets: 4 query heads, 2 KV heads (GQA) of 16.
_DENSE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

ARCHS: dict[str, dict[str, Any]] = {
    # KVCache x 2
    "llama": {"model_type": "llama", **_DENSE, "tie_word_embeddings": True},
    # KVCache x 2 (q/k norms)
    "qwen3": {"model_type": "qwen3", **_DENSE, "tie_word_embeddings": True},
    # KVCache x 2; computes its own attention (soft-capped scores), not mlx-lm's
    # scaled_dot_product_attention: the model shared-prefix attention cannot hook
    "gemma2": {"model_type": "gemma2", **_DENSE, "query_pre_attn_scalar": 16},
    # every 2nd layer is global: Rotating, KV, Rotating, KV
    "gemma3_text": {
        "model_type": "gemma3_text",
        **_DENSE,
        "num_hidden_layers": 4,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    # gated delta net (ArraysCache) and attention alternate; MoE on layers 1 and 3
    "qwen3_next": {
        "model_type": "qwen3_next",
        **_DENSE,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
    },
    # short convolutions (ArraysCache) around one attention layer
    "lfm2": {
        "model_type": "lfm2",
        **_DENSE,
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
    },
    # recurrent only: ArraysCache(conv state, ssm state) x 2
    "mamba2": {
        "model_type": "mamba2",
        "vocab_size": VOCAB_SIZE,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, 100.0],
        "time_step_rank": "auto",
        "tie_word_embeddings": True,
    },
    # chunked attention on layers 0-2, global on 3 (mlx-lm hardcodes every 4th); MoE on 1, 3
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            **_DENSE,
            "num_hidden_layers": 4,
            "attention_chunk_size": 32,
            "attention_bias": False,
            "use_qk_norm": True,
            "rope_scaling": None,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
        },
    },
    # every layer: CacheList(ArraysCache (mamba), KVCache (attention)) x 2
    "falcon_h1": {
        "model_type": "falcon_h1",
        **_DENSE,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 32,
        "tie_word_embeddings": True,
        # the tied head scales logits by lm_head/embedding multiplier (0.007 by default)
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
    },
    # deepseek_v41's own LayerCache on every layer: a 16-token window, then tokens
    # compressed in groups of 4 (layers 1, 3) and 16 (layer 2) with index keys
    "deepseek_v41": {
        "model_type": "deepseek_v41",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": 16,
        "compress_ratios": [0, 4, 16, 4],
        "kv_source_layer_ids": [1, 2, 3],
        "index_source_layer_ids": [1, 2, 3],
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "max_position_embeddings": 4096,
        "hc_mult": 2,
    },
}
