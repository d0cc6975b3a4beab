"""A tiny vision model that mlx-lm's server takes images for, built offline.

mlx-lm 0.32.2 serves images with ``muse_spark`` only (its processor is the one
``mlx_lm.processors`` has). ``save_vision_model`` writes a random-weight
muse_spark directory from its ``ModelArgs`` (text and vision config) with a
tokenizer holding the processor's image tokens and a chat template that puts
``<|patch|>`` where a message has an image. Its kernels are Metal's: on a CPU
run it with ``muse_cpu.install()`` (or ``python -m prefixcache.tiny.muse_cpu``).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .archs import VOCAB_SIZE
from .models import EOS_TOKEN, SPECIAL_TOKENS, build_from_config, save_tokenizer

IMAGE_TOKENS = ("<|image_start|>", "<|patch|>", "<|image_end|>")  # muse_spark's processor
PATCH_TOKEN = IMAGE_TOKENS[1]
# A content list renders its text parts and one <|patch|> per image part; the
# processor expands each <|patch|> to the rows of its image.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<|patch|>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Patches of 4 pixels merged 2 x 2: one image token per 8 x 8 pixels.
PATCH_SIZE = 4
MERGE_SIZE = 2


def vision_config(*, image_token_id: int, sliding_window: int | None = None) -> dict[str, Any]:
    """A muse_spark config: 2 text layers with 4 experts (full attention, or the first
    one a ``sliding_window``), a 1-layer vision tower."""
    first = "full_attention" if sliding_window is None else "sliding_attention"
    text = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": 1e-5,
        "post_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_rope_theta": [10000.0, 10000.0],
        "layer_types": [first, "full_attention"],
        "sliding_window": sliding_window or 4096,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_hidden_size": 32,
        "moe_intermediate_size": 32,
        "mlp_layer_types": ["sparse", "sparse"],
    }
    tower = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "pos_emb_height": 16,
        "pos_emb_width": 16,
    }
    return {
        "model_type": "muse_spark",
        "text_config": text,
        "vision_config": tower,
        "image_token_id": image_token_id,
        "projector_hidden_size": 64,
        # not built by mlx-lm; transformers' config check (the tokenizer loads it) wants it
        "audio_config": {"out_hidden_size": 64},
    }


def save_vision_model(
    path: str | Path, *, seed: int = 0, sliding_window: int | None = None
) -> Path:
    """Write a tiny muse_spark directory that ``mlx_lm.server`` serves images with
    (``sliding_window``: its first layer attends to a window, a RotatingKVCache).

    Its tokenizer has no ``chat_template_type``, so replies are plain text
    (muse_spark's default response format would drop text outside its headers).
    """
    from mlx_lm.utils import save_config
    from mlx_lm.utils import save_model as save_weights

    path = Path(path)
    ids = save_tokenizer(
        path,
        VOCAB_SIZE,
        specials=(*SPECIAL_TOKENS, *IMAGE_TOKENS),
        chat_template=VISION_CHAT_TEMPLATE,
        chat_template_type="",
    )
    config = vision_config(image_token_id=ids[PATCH_TOKEN], sliding_window=sliding_window)
    save_weights(path, build_from_config(config, seed=seed, dtype=mx.float32))
    config["eos_token_id"] = ids[EOS_TOKEN]
    save_config(config, path / "config.json", keep_vision_config=True)
    return path


def image_url(seed: int, size: int = 64) -> str:
    """A PNG data URL of a ``size`` x ``size`` RGB image drawn from ``seed``."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
