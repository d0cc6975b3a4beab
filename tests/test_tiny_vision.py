"""The tiny vision model (prefixcache/tiny/vision.py), muse_spark's kernels on a CPU
(prefixcache/tiny/muse_cpu.py), and a restore past an image in process."""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import _decode_image
from mlx_lm.utils import load

from prefixcache.config import CacheConfig
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiny import muse_cpu
from prefixcache.tiny.vision import PATCH_TOKEN, image_url, save_vision_model


def test_rope_kernel_rotates_as_mlx_traditional_rope():
    heads, kv_heads, dim, offset = 4, 2, 16, 37
    qkvg = mx.random.normal((1, 5, 2 * (heads + kv_heads) * dim), key=mx.random.key(0))
    args = {"n_heads": heads, "n_kv_heads": kv_heads, "head_dim": dim, "eps": 1e-5}
    q, k = muse_cpu.qk_norm(qkvg, **args, query_scale=2.0)
    rq, rk = muse_cpu.qk_norm_rope(qkvg, **args, query_scale=2.0, rope_base=1e4, offset=offset)
    for plain, rotated in ((q, rq), (k, rk)):
        ref = mx.fast.rope(
            plain.transpose(0, 2, 1, 3), dim, traditional=True, base=1e4, scale=1.0, offset=offset
        ).transpose(0, 2, 1, 3)
        assert mx.allclose(rotated, ref, atol=1e-5)
        assert not mx.allclose(rotated, plain, atol=1e-3)  # it does rotate
    # q is normed per head, then scaled
    norms = mx.sqrt(mx.mean(q.astype(mx.float32) ** 2, axis=-1))
    assert mx.allclose(norms, mx.full(norms.shape, 2.0), atol=1e-3)


def test_norm_kernels_and_routing():
    branch = mx.random.normal((1, 3, 8), key=mx.random.key(1))
    stream = mx.random.normal((1, 3, 8), key=mx.random.key(2))
    norm = nn.RMSNorm(8, eps=1e-6)
    alpha, beta = mx.full((8,), 0.5), mx.full((8,), 2.0)
    new, normed = muse_cpu.norm_add_norm(
        branch, stream, alpha=alpha, beta=beta, post_weight=None, post_eps=1e-6, next_norm=norm
    )
    assert mx.allclose(new, 0.5 * stream + 2.0 * mx.fast.rms_norm(branch, None, 1e-6), atol=1e-5)
    assert mx.allclose(normed, norm(new), atol=1e-5)
    logits = mx.array([[0.0, 3.0, -1.0, 2.0]])
    inds, weights = muse_cpu.expert_routing(
        logits, mx.zeros((4,)), top_k=2, multiplier=1.0, score_eps=0.0, route_scale=1.0
    )
    assert inds.tolist() == [[1, 3]]
    s1, s3 = 1 / (1 + math.exp(-3)), 1 / (1 + math.exp(-2))
    assert mx.allclose(weights, mx.array([[s1 / (s1 + s3), s3 / (s1 + s3)]]), atol=1e-6)


@pytest.fixture
def cpu_kernels(monkeypatch):
    from mlx_lm.models import muse_spark

    for name in muse_cpu.KERNELS:  # put mlx-lm's back after the test
        monkeypatch.setattr(muse_spark, name, getattr(muse_spark, name))
    muse_cpu.install()


def test_vision_model_embeds_an_image_at_its_patch_tokens(tmp_path, cpu_kernels):
    model, tokenizer, config = load(str(save_vision_model(tmp_path / "m")), return_config=True)
    processor = load_processor(model, config)
    content = [{"type": "image_url"}, {"type": "text", "text": "Hi"}]
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(PATCH_TOKEN) == 1
    text, pixels = processor(text, images=[_decode_image(image_url(0))])
    ids = tokenizer.encode(text, add_special_tokens=False)
    patch = tokenizer.convert_tokens_to_ids(PATCH_TOKEN)
    assert ids.count(patch) == 64 and config["image_token_id"] == patch  # 64 x 64 pixels
    rows = model.embed_inputs(mx.array(ids), pixel_values=pixels)
    plain = model.embed_inputs(mx.array(ids))
    same = mx.all(rows == plain, axis=-1).tolist()
    assert same == [t != patch for t in ids]  # the image's rows replace the patches' only
    other = model.embed_inputs(mx.array(ids), pixel_values=[-p for p in pixels])
    assert not mx.allclose(rows, other)  # the rows depend on the pixels
    assert model(mx.array([ids]), input_embeddings=rows[None]).shape == (1, len(ids), 512)


def _image_prompt(tokenizer, processor, image: int, text: str):
    """(token ids, mlx-lm's Vision: its pixel values and cache key) of a chat whose user
    message holds ``image`` and ``text``, as mlx-lm's server tokenizes it."""
    url = image_url(image)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    system = {"role": "system", "content": "Describe it. " * 8}
    messages = [system, {"role": "user", "content": content}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat, pixels = processor(chat, images=[_decode_image(url)])
    ids = tokenizer.encode(chat, add_special_tokens=False)
    patch = tokenizer.convert_tokens_to_ids(PATCH_TOKEN)
    return ids, server._make_vision(ids, urls=[url], pixel_values=pixels, token_id=patch)


def test_a_restore_past_an_image_gives_the_live_run_logits(tmp_path, cpu_kernels):
    """The server's path in process: a prompt with an image prefilled and inserted under
    mlx-lm's cache key; a longer prompt restores past the image, and its next logits
    equal the live cache's bit for bit. The same prompt with another image restores up
    to that image's first patch only, and the image changes the logits (the control)."""
    path = save_vision_model(tmp_path / "m", sliding_window=64)  # a window layer, wrapped
    model, tokenizer, config = load(str(path), return_config=True)
    processor = load_processor(model, config)
    ids, vision = _image_prompt(tokenizer, processor, 1, "What is it?")
    live = make_prompt_cache(model)
    rows = model.embed_inputs(mx.array(ids), pixel_values=vision.pixel_values)
    first = model(mx.array([ids]), cache=live, input_embeddings=rows[None])
    mx.eval(first, [c.state for c in live])
    more = tokenizer.encode("And the colours?", add_special_tokens=False)
    key = ("/models/vision", None, None)
    with TieredPromptCache(lambda k: model, CacheConfig(block_size=16, hot_cache_only=True)) as tc:
        tc.insert_cache(key, vision.cache_key, copy.deepcopy(live))
        restored, rest = tc.fetch_nearest_cache(key, vision.cache_key + more)
        assert rest == more
        ours = model(mx.array([rest]), cache=restored)
        assert mx.array_equal(ours, model(mx.array([more]), cache=live))
        other_ids, other = _image_prompt(tokenizer, processor, 2, "What is it?")
        restored, rest = tc.fetch_nearest_cache(key, other.cache_key + more)
        assert len(rest) == len(other_ids) + len(more) - other.starts[0]
    other_rows = model.embed_inputs(mx.array(other_ids), pixel_values=other.pixel_values)
    other_first = model(mx.array([other_ids]), input_embeddings=other_rows[None])
    assert not mx.array_equal(other_first, first)
