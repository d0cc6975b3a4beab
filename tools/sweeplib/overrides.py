"""Per-module fixes over configs.SMALL for the architecture sweep.

Names a module uses differently, layer patterns that must match the layer
count, sizes with a ratio between them; the presets of prefixcache.tiny
(lfm2, llama4, falcon_h1, ...) first.
"""

from __future__ import annotations

from typing import Any

from prefixcache.tiny.archs import ARCHS

from .sizes import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB

SWA = ["sliding_attention", "full_attention"] * (LAYERS // 2)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA4_ROPE = {  # ministral3 / mistral4 scale queries by position like llama 4
    "rope_type": "default",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 4096,
}

# Per-module fixes over SMALL: names a module uses differently, patterns that
# must match the layer count, sizes with a ratio between them. The presets of
# prefixcache.tiny (lfm2, llama4, falcon_h1, ...) come first.
OVERRIDES: dict[str, dict[str, Any]] = {
    **{name: dict(preset) for name, preset in ARCHS.items()},
    "afmoe": {"layer_types": SWA, "num_dense_layers": 1},
    # groups of 2 layers, linear attention then full attention
    "bailing_moe_linear": {"num_key_value_heads": 4, "layer_group_size": 2, "group_norm_size": 1},
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "deepseek_v2": {
        "rope_scaling": {
            "factor": 1.0,
            "mscale_all_dim": 0,
            "mscale": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    },
    "minicpm3": {
        "rope_scaling": {
            "short_factor": [1.0] * 4,
            "long_factor": [1.0] * 4,
            "original_max_position_embeddings": 4096,
        }
    },
    "exaone4": {"sliding_window_pattern": "LG", "rope_scaling": None},
    "exaone_moe": {
        "layer_types": SWA,
        "is_moe_layer": [False, True] * (LAYERS // 2),
        "topk_method": "noaux_tc",
        "rope_parameters": ROPE,
    },
    "gear": {"layer_types": SWA},
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        }
    },
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
        "rope_parameters": ROPE,
    },
    "lfm2-vl": {"text_config": dict(ARCHS["lfm2"])},
    "mellum": {"layer_types": SWA, "rope_parameters": {t: ROPE for t in set(SWA)}},
    "spark2_5": {
        "layer_types": SWA,
        "rope_parameters": {t: ROPE for t in set(SWA)},
        "hidden_act": "gelu",
        "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid",
    },
    "ministral3": {"layer_types": SWA, "rope_parameters": LLAMA4_ROPE},
    "mistral3": {
        "text_config": {
            "model_type": "ministral3",
            "layer_types": SWA,
            "rope_parameters": LLAMA4_ROPE,
        }
    },
    "mistral4": {"rope_parameters": LLAMA4_ROPE},
    "glm_moe_dsa": {"rope_parameters": ROPE, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"] * (LAYERS // 2),
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_chunk_size": 32,
    },
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0] * (LAYERS // 2),
        "moe_layer_freq": [0, 1] * (LAYERS // 2),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "swa_rope_theta": 10000.0,
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "M", "-"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
    },
    "recurrent_gemma": {
        "block_types": ["recurrent", "attention"],
        "attention_window_size": 16,
        "lru_width": 64,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
    },
    "minimax": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "step3p5": {"moe_top_k": 2, "moe_num_experts": 4, "layer_types": SWA},
    "qwen": {"kv_channels": 16},
    "afm7": {"num_kv_reuse_layers": 2},
    "baichuan_m1": {
        "sliding_window_layers": [0, 2],
        "conv_window": 2,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "llama4_text": {**ARCHS["llama4"]["text_config"], "no_rope_layers": [1, 1, 1, 0]},
    "muse_spark": {
        "text_config": {
            "post_norm_eps": 1e-5,
            "rope_parameters": ROPE,
            "layer_rope_theta": [10000.0] * LAYERS,
            "layer_types": SWA,
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
            "moe_hidden_size": 32,
            "mlp_layer_types": ["sparse"] * LAYERS,
            "num_shared_experts": 0,
        }
    },
    "gemma4_text": {"layer_types": SWA, "num_kv_shared_layers": 0},
    "gemma4": {"text_config": {"layer_types": SWA, "num_kv_shared_layers": 0}},
    "openelm": {
        "model_dim": HIDDEN,
        "num_query_heads": [HEADS] * LAYERS,
        "num_kv_heads": [KV_HEADS] * LAYERS,
        "ffn_multipliers": [2.0] * LAYERS,
        "num_transformer_layers": LAYERS,
        "ffn_dim_divisor": 16,
    },
    "plamo": {"n_shared_head": 2},
    "kimi_k3": {
        "text_config": {
            "num_experts_per_token": 2,
            "linear_attn_config": {
                "kda_layers": [1, 3],
                "full_attn_layers": [2, 4],
                "head_dim": 16,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
            },
        }
    },
    "longcat_flash": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_type": "identity",
    },
    "minimax_m3_vl": {"text_config": {"moe_layer_freq": [1] * LAYERS}},
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}},
        ]
    },
    "gemma3n": {
        "text_config": {
            "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": VOCAB,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": SWA,
            "activation_sparsity_pattern": [0.0] * LAYERS,
            "hidden_size_per_layer_input": 16,
            "altup_num_inputs": 2,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "laurel_rank": 8,
        }
    },
    "phixtral": {"num_vocab": VOCAB, "model_dim": HIDDEN, "rotary_dim": 8},
}
