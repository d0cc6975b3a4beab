"""Tiny offline models: presets, determinism, prefix memory, save/load, tokenizer."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, make_prompt_cache

from prefixcache.tiny.models import (
    ARCHS,
    CORPUS_PATH,
    EOS_TOKEN,
    VOCAB_SIZE,
    build_model,
    save_model,
)

# The layer layout each preset exists to provide (see MLX_CACHES.md).
EXPECTED_CACHES = {
    "llama": ["KVCache"] * 2,
    "qwen3": ["KVCache"] * 2,
    "gemma2": ["KVCache"] * 2,
    "gemma3_text": ["RotatingKVCache", "KVCache"] * 2,
    "qwen3_next": ["ArraysCache", "KVCache"] * 2,
    "lfm2": ["ArraysCache", "KVCache", "ArraysCache"],
    "mamba2": ["ArraysCache"] * 2,
    "llama4": ["ChunkedKVCache"] * 3 + ["KVCache"],
    "falcon_h1": ["CacheList(ArraysCache, KVCache)"] * 2,
    "deepseek_v41": ["LayerCache"] * 4,
}
TOKENS = mx.array([list(range(3, 67))])  # 64 tokens: past the window (16) and a chunk (32)


def cache_name(cache) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({', '.join(cache_name(c) for c in cache.caches)})"
    return type(cache).__name__


def no_download(*args, **kwargs):
    raise AssertionError(f"mlx_lm tried to download: {args} {kwargs}")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(mlx_lm.utils, "snapshot_download", no_download)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0)


@pytest.fixture
def loaded(tiny_dir, offline):
    return mlx_lm.load(str(tiny_dir))


def test_presets_cover_expected_layouts():
    assert set(ARCHS) == set(EXPECTED_CACHES)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_preset_builds_and_runs(arch):
    model = build_model(arch)
    cache = make_prompt_cache(model)
    assert [cache_name(c) for c in cache] == EXPECTED_CACHES[arch]
    logits = model(TOKENS, cache=cache)
    step = model(mx.array([[7]]), cache=cache)
    assert logits.shape == (1, TOKENS.shape[1], VOCAB_SIZE)
    assert step.shape == (1, 1, VOCAB_SIZE)
    assert mx.all(mx.isfinite(logits)).item() and mx.all(mx.isfinite(step)).item()
    # random weights at a sane scale: neither collapsed nor saturated
    assert 0.3 < logits.std().item() < 5.0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_seed_determines_weights(arch):
    same = build_model(arch, seed=0)(TOKENS), build_model(arch, seed=0)(TOKENS)
    other = build_model(arch, seed=1)(TOKENS)
    assert mx.array_equal(*same).item()
    assert mx.abs(same[0] - other).max().item() > 0.1


def test_unknown_arch_lists_known():
    with pytest.raises(ValueError, match=r"'gpt5'.*llama, llama4"):
        build_model("gpt5")


def test_dtype_cast_and_moe_float32_only():
    model = build_model("llama", dtype=mx.bfloat16)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert model(TOKENS).dtype == mx.bfloat16
    with pytest.raises(ValueError, match="float32"):
        build_model("qwen3_next", dtype=mx.bfloat16)


def last_logits_change(model) -> float:
    """Max |diff| of the last token's logits when only token 0 changes."""
    changed = mx.concatenate([mx.array([[400]]), TOKENS[:, 1:]], axis=1)
    return mx.abs(model(TOKENS)[0, -1] - model(changed)[0, -1]).max().item()


def test_mamba2_prefix_matters_only_with_slow_decay():
    model = build_model("mamba2")
    assert last_logits_change(model) > 0.05
    # negative control: mlx-lm's default decay forgets token 0 within 63 tokens,
    # so a prefix test on it would pass no matter what state was restored
    params = dict(tree_flatten(model.parameters()))
    defaults = []
    for name, v in params.items():
        if name.endswith("A_log"):
            defaults.append((name, mx.log(mx.arange(1, v.shape[0] + 1, dtype=mx.float32))))
        elif name.endswith("dt_bias"):
            defaults.append((name, mx.ones_like(v)))
    assert len(defaults) == 4
    model.load_weights(defaults, strict=False)
    assert last_logits_change(model) < 1e-4


def test_qwen3_next_recurrent_state_carries_prefix():
    model = build_model("qwen3_next")
    assert last_logits_change(model) > 0.05
    states = []
    for first in (TOKENS[:, :1], mx.array([[400]])):
        cache = make_prompt_cache(model)
        model(mx.concatenate([first, TOKENS[:, 1:]], axis=1), cache=cache)
        states.append(cache[0].cache[1])  # gated delta net state of layer 0
    # the change in token 0 survives 63 tokens of recurrence, not just attention
    assert mx.abs(states[0] - states[1]).max().item() > 1e-3 * mx.abs(states[0]).max().item()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_save_load_roundtrip_is_exact(arch, tmp_path, offline):
    path = save_model(tmp_path / arch, arch, seed=3)
    model, _ = mlx_lm.load(str(path))
    assert mx.array_equal(model(TOKENS), build_model(arch, seed=3)(TOKENS)).item()


def test_tokenizer_roundtrips_corpus_and_more(loaded):
    _, tokenizer = loaded
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    assert len(ids) < len(text) / 2  # the merges were learned
    assert max(ids) < VOCAB_SIZE
    assert tokenizer.decode(ids) == text
    odd = "Ünïcödé 🙂 tabs\tand  double  spaces\n"
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


def test_chat_template_and_eos(loaded):
    _, tokenizer = loaded
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a cache?"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is a cache?<|im_end|>\n<|im_start|>assistant\n"
    )
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert tokenizer.eos_token_ids == {eos}
    assert tokenizer.encode("<|im_start|>")[-1:] == [
        tokenizer.convert_tokens_to_ids("<|im_start|>")
    ]


def test_generate_runs(loaded):
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True
    )
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=5)
    assert isinstance(text, str)


def test_make_model_script(tmp_path, monkeypatch, offline):
    script = Path(__file__).parents[1] / "tools" / "make_model.py"
    out = tmp_path / "m"
    monkeypatch.setattr(sys, "argv", [str(script), str(out), "--arch", "mamba2", "--seed", "5"])
    runpy.run_path(str(script), run_name="__main__")
    model, _ = mlx_lm.load(str(out))
    assert mx.array_equal(model(TOKENS), build_model("mamba2", seed=5)(TOKENS)).item()
