"""Tiny random-weight mlx-lm models and a matching tokenizer, built offline.

Tests, the demo and the CLI need real mlx-lm architectures (every cache type:
KVCache, RotatingKVCache, ChunkedKVCache, ArraysCache, CacheList) without
downloading anything. ``build_model`` makes one in memory from a preset of
``ARCHS``; ``save_model`` writes a directory that ``mlx_lm.load`` and
``mlx_lm.server`` open as if it came from the Hub, with a byte-level BPE
tokenizer trained on the corpus shipped in ``prefixcache/tiny/data/corpus.txt``.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .archs import ARCHS, VOCAB_SIZE

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that strips reasoning from every assistant message but the last, as
# reasoning models' templates do: an agent's next turn re-renders the previous one.
STRIP_THINKING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 != ns.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Recurrent decay: A = -exp(A_log) and dt = softplus(x + dt_bias); a small A and
# a small dt keep exp(dt * A) close to 1, so the state remembers the prefix.
SLOW_A_LOG = math.log(0.01)
SLOW_DT_BIAS = -4.0


def model_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config dict of a preset with ``overrides`` applied.

    A dict override is merged into the preset's dict of the same key, so
    ``text_config={"num_hidden_layers": 8}`` changes one field of llama4.

    Raises:
        ValueError: if ``arch`` is not a key of ``ARCHS``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(sorted(ARCHS))}")
    config = json.loads(json.dumps(ARCHS[arch]))  # deep copy
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = config[key] | value
        else:
            config[key] = value
    return config


def build_model(
    arch: str, *, seed: int = 0, dtype: mx.Dtype = mx.float32, **overrides: Any
) -> nn.Module:
    """Build a tiny random-weight mlx-lm model.

    Args:
        arch: a key of ``ARCHS`` (also the ``mlx_lm.models`` module name).
        seed: weights are a pure function of ``seed`` and the config.
        dtype: floating-point dtype of the parameters. MoE presets
            (qwen3_next, llama4) only run in float32 on CPU.
        **overrides: config fields that replace the preset's.

    Returns:
        The model, in eval mode, with its parameters evaluated. MLX's global
        random generator is left seeded with ``seed``.

    Raises:
        ValueError: if ``arch`` is unknown, or ``dtype`` is not float32 for a
            model with MoE layers.
    """
    config = model_config(arch, **overrides)
    return build_from_config(config, seed=seed, dtype=dtype)


def build_from_config(
    config: dict[str, Any], *, seed: int = 0, dtype: mx.Dtype = mx.float32
) -> nn.Module:
    """Build a random-weight model of ``mlx_lm.models.{config["model_type"]}`` from a
    config dict, as ``build_model`` does for a preset (any module: the architecture
    sweep builds every one).

    Raises:
        ValueError: ``dtype`` is not float32 for a model with MoE layers.
    """
    from mlx_lm.models.switch_layers import SwitchGLU

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # GatherMM (the expert matmul) fails at the first forward otherwise
    if dtype != mx.float32 and any(isinstance(m, SwitchGLU) for m in model.modules()):
        name = config["model_type"]
        raise ValueError(f"{name} has MoE layers, which run only in float32 on CPU, not {dtype}")
    _init_weights(model, seed)
    model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def _init_weights(model: nn.Module, seed: int) -> None:
    """Re-draw every matrix from ``seed`` and slow down recurrent decay.

    Each parameter gets its own key (by sorted name), so the weights do not
    depend on how many random draws the constructors happen to make.
    """
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, value), key in zip(params, keys, strict=True):
        leaf = name.rsplit(".", 1)[-1]
        if value.ndim >= 2:
            # conv weights are (out, kernel, in/groups); the rest (..., out, in)
            fan_in = math.prod(value.shape[1:]) if "conv" in name else value.shape[-1]
            value = mx.random.normal(value.shape, key=key) * fan_in**-0.5
        elif leaf == "bias":
            value = mx.zeros_like(value)
        elif leaf == "A_log":
            value = mx.full(value.shape, SLOW_A_LOG)
        elif leaf == "dt_bias":
            value = mx.full(value.shape, SLOW_DT_BIAS)
        new.append((name, value))
    model.update(tree_unflatten(new))


@functools.cache
def _tokenizer_json(vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS) -> str:
    """Train a byte-level BPE tokenizer on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer.to_str()


def _vocab_size(config: dict[str, Any]) -> int:
    return config.get("text_config", config)["vocab_size"]


def save_tokenizer(
    path: str | Path,
    vocab_size: int = VOCAB_SIZE,
    *,
    specials: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
    **config_fields: Any,
) -> dict[str, int]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and the special tokens map.

    Args:
        specials: the special tokens, ``SPECIAL_TOKENS`` first.
        chat_template: the Jinja chat template.
        **config_fields: more fields of ``tokenizer_config.json``.

    Returns:
        The id of each special token.

    Raises:
        ValueError: if ``vocab_size`` cannot hold the 256 bytes and the specials.
    """
    min_size = 256 + len(specials)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size {vocab_size} < {min_size} (bytes + special tokens)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json(vocab_size, specials)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    special = {"eos_token": EOS_TOKEN, "pad_token": SPECIAL_TOKENS[0]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": list(specials[1:]),
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        **config_fields,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return {t["content"]: t["id"] for t in json.loads(text)["added_tokens"]}


def save_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    chat_template: str = CHAT_TEMPLATE,
    **overrides: Any,
) -> Path:
    """Write a tiny model directory that ``mlx_lm.load`` and ``mlx_lm.server`` open offline.

    The directory holds ``config.json`` (with ``eos_token_id``),
    ``model.safetensors`` and the tokenizer files of ``save_tokenizer``.

    Args:
        path: directory to create (or overwrite files in).
        arch: a key of ``ARCHS``.
        seed: weight seed, as in ``build_model``.
        dtype: weight dtype, as in ``build_model``.
        chat_template: the tokenizer's chat template (``STRIP_THINKING_TEMPLATE``:
            reasoning stripped from earlier assistant turns).
        **overrides: config fields that replace the preset's.

    Returns:
        ``path`` as a ``Path``.
    """
    from mlx_lm.utils import save_config
    from mlx_lm.utils import save_model as save_weights

    path = Path(path)
    config = model_config(arch, **overrides)
    model = build_model(arch, seed=seed, dtype=dtype, **overrides)
    save_weights(path, model)
    ids = save_tokenizer(path, _vocab_size(config), chat_template=chat_template)
    config["eos_token_id"] = ids[EOS_TOKEN]
    save_config(config, path / "config.json")
    return path
