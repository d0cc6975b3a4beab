"""Shared fixtures: tiny random-weight mlx-lm models built offline, prefill helpers."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from prefixcache.config import CacheConfig
from prefixcache.tiers.ssd.tier import SsdTier
from prefixcache.tiny.models import build_model

# head_dim 32 so kv_group_size 32 divides it; one kv head exercises the
# "slice is already contiguous" trap of mx.contiguous.
QUANT_LLAMA = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


QUANT_LLAMA4 = {"text_config": QUANT_LLAMA}  # llama4's dims sit in its text_config


_MODELS: dict[tuple[str, int, str], object] = {}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny model, built once per (arch, seed, overrides) (dict overrides too)."""
    key = (arch, seed, repr(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(arch, seed=seed, **overrides)
    return _MODELS[key]


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def prefill(model, tokens, cache, *, step: int = 16, kv: tuple | None = None) -> mx.array:
    """Run ``tokens`` through the model in chunks of ``step``; last-token logits.

    ``kv`` = (bits, group_size, start) applies mlx-lm's quantization schedule
    after each chunk, as generate_step does.
    """
    logits = None
    for start in range(0, len(tokens), step):
        logits = model(mx.array([tokens[start : start + step]]), cache=cache)[:, -1, :]
        if kv is not None:
            maybe_quantize_kv_cache(cache, kv[2], kv[1], kv[0])
        mx.eval(logits, [c.state for c in cache])
    return logits


def live_logits(model, tokens, split: int, *, step: int = 16, kv: tuple | None = None):
    """Logits of ``tokens`` computed live, with a chunk boundary at ``split``."""
    cache = make_prompt_cache(model)
    if split:
        prefill(model, tokens[:split], cache, step=step, kv=kv)
    return prefill(model, tokens[split:], cache, step=step, kv=kv)


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def store_fetch_in_threads(pc, users, caches, rounds: int) -> None:
    """Each thread stores its prompt's cache and fetches it back ``rounds`` times.

    Every restored prefix must equal the live cache's keys; failures in any
    thread are re-raised here.
    """
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(rounds):
                pc.store(users[i], caches[i])
                cache, n = pc.fetch(users[i])
                want = np.array(caches[i][0].keys[..., :n, :])
                assert np.array_equal(np.array(cache[0].keys[..., :n, :]), want)
        except BaseException as err:  # re-raised in the calling thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(users))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.fixture
def keep_freed_buffers():
    """Let MLX keep freed buffers for reuse (its CPU default keeps only a little)."""
    old = mx.set_cache_limit(1 << 30)
    mx.clear_cache()
    yield
    mx.set_cache_limit(old)
    mx.clear_cache()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a loopback port, stopped after the test."""
    from redis_server import RedisServer

    server = RedisServer(str(tmp_path))
    yield server
    server.stop()


@pytest.fixture
def tier(tmp_path):
    """An SSD tier in a temp dir (1 GiB cap, no free-space floor), one payload file
    per block (run files: test_ssd_run_files.py); a module may define its own ``tier``."""
    t = SsdTier(
        CacheConfig(
            ssd_dir=str(tmp_path / "ssd"),
            ssd_max_bytes=1 << 30,
            ssd_min_free_bytes=0,
            ssd_run_tokens=0,
        )
    )
    yield t
    t.close()
