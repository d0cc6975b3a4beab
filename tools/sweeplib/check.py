"""The exactness check of one architecture, on the hot and the SSD tier.

A first prompt (a 96-token shared prefix and 37 tokens of its own) goes
through ``PrefixCache.prefill``; a second prompt sharing the prefix is
matched, then prefilled the same way (restoring what the first left). Its
last logits must equal, bit for bit, a live run chunked alike: the first
prompt's chunks up to the restore point, then the second's. The control: the
same live run on another prefix must give other logits, or the check could
not tell a wrong restore from a right one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import LayoutMismatchError, UnsupportedCacheError
from prefixcache.tiny import muse_cpu
from prefixcache.tiny.models import build_from_config

from . import configs
from .sizes import VOCAB

BLOCK = 16
SHARED = 96
OUTCOMES = ("pass", "no reuse", "wrong", "unsupported", "error", "not built")


@dataclass(frozen=True, slots=True)
class Result:
    """One architecture's line of the sweep.

    Attributes:
        arch: the ``mlx_lm.models`` module.
        caches: the cache classes its layers use.
        outcome: one of ``OUTCOMES`` (the worse of the two tiers).
        reused_hot, reused_ssd: tokens the second prompt restored from each tier.
        max_diff: the largest |logit difference| against the live run.
        detail: why, where the outcome is not a pass.
    """

    arch: str
    caches: str
    outcome: str
    reused_hot: int = 0
    reused_ssd: int = 0
    max_diff: float = 0.0
    detail: str = ""


class Chunks:
    """The model, counting the tokens of each forward (the prefill's chunks)."""

    def __init__(self, model: Any):
        self.model = model
        self.sizes: list[int] = []

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.sizes.append(inputs.shape[1])
        return self.model(inputs, cache=cache)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def describe(cache: Sequence[Any]) -> str:
    """The cache classes of a cache list, each once, in layer order."""

    def name(c: Any) -> str:
        if isinstance(c, CacheList):
            return f"CacheList[{','.join(name(s) for s in c.caches)}]"
        return type(c).__name__

    return " ".join(dict.fromkeys(name(c) for c in cache))


def build(arch: str) -> Any:
    """The tiny model of ``arch`` (float32: MoE runs only in float32 on CPU), run once.

    Raises:
        ImportError, ValueError, ...: the module cannot be built or run here.
    """
    if arch == "muse_spark":  # its fused kernels are Metal's: run their MLX versions
        muse_cpu.install()
    module = configs.load(arch)
    if module is None:
        raise ImportError(f"mlx_lm.models.{arch} defines no ModelArgs and Model")
    config = configs.config_for(arch, module.ModelArgs)
    config["model_type"] = arch  # the module to build, whatever the config calls itself
    model = build_from_config(config, seed=0, dtype=mx.float32)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))
    return model


def live(model: Any, tokens: list[int], ends: Sequence[int]) -> mx.array:
    """Last logits of ``tokens`` run cold in chunks ending at ``ends`` (then the end)."""
    cache, start, logits = make_prompt_cache(model), 0, None
    for end in [*ends, len(tokens)]:
        if end > start:
            logits = model(mx.array([tokens[start:end]]), cache=cache)[:, -1, :]
            mx.eval(logits, [c.state for c in cache])
            start = end
    return logits


def diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def run_tier(
    model: Any, tier: str, step: int, ssd_dir: str, ratio: float, interval: int = 0
) -> tuple[int, float, float]:
    """(tokens reused, |restored - live|, |live - live on another prefix|) on one tier;
    ``ratio``, ``interval``: the cache's ``snapshot_ratio`` and ``snapshot_interval``
    (where the first prefill keeps restore points for recurrent and window layers)."""
    config = CacheConfig(
        block_size=BLOCK, hot_cache_only=True, snapshot_ratio=ratio, snapshot_interval=interval
    )
    if tier == "ssd":
        config = config.replace(
            hot_cache_only=False, ssd_dir=ssd_dir, hot_max_bytes=1, write_policy="write_through"
        )
    shared = prompt(1, SHARED)
    first, second = shared + prompt(2, 37), shared + prompt(3, 29)
    with PrefixCache(model, config, model_id="sweep") as pc:
        chunks = Chunks(model)
        pc.model = chunks
        pc.prefill(first, prefill_step_size=step)
        ends1 = list(accumulate(chunks.sizes))
        pc.flush()
        chunks.sizes.clear()
        _, restored = pc.prefill(second, prefill_step_size=step)
        reused = len(second) - sum(chunks.sizes)
        ends2 = list(accumulate(chunks.sizes, initial=reused))[:-1]
        if tier == "ssd" and reused and not pc.stats()["ssd_block_hits"]:
            raise RuntimeError("the SSD pass restored nothing from the SSD tier")
    ends = [e for e in ends1 if e < reused] + ends2
    want = live(model, second, ends)
    control = live(model, prompt(4, SHARED) + second[SHARED:], ends)
    return reused, diff(restored, want), diff(control, want)


def check(
    arch: str,
    step: int,
    on_built: Callable[[str], None] | None = None,
    *,
    ratio: float = 1.0,
    interval: int = 0,
) -> Result:
    """Build ``arch`` and run the exactness check on both tiers (prefill step ``step``,
    ``snapshot_ratio`` ``ratio``, ``snapshot_interval`` ``interval``); ``on_built``
    hears the cache classes once the model runs (a later crash is then no build failure)."""
    try:
        model = build(arch)
    except Exception as err:  # any failure to build or run the module is its outcome
        return Result(arch, "", "not built", detail=f"{type(err).__name__}: {err}"[:160])
    caches = describe(make_prompt_cache(model))
    if on_built is not None:
        on_built(caches)
    reused, worst = {}, 0.0
    try:
        with tempfile.TemporaryDirectory(prefix="arch-sweep-") as tmp:
            for tier in ("hot", "ssd"):
                reused[tier], gap, control = run_tier(model, tier, step, tmp, ratio, interval)
                worst = max(worst, gap)
                if control == 0.0 and reused[tier]:
                    msg = "control: another prefix gives the same logits"
                    return Result(arch, caches, "error", *reused.values(), 0, gap, msg)
    except UnsupportedCacheError as err:
        return Result(arch, caches, "unsupported", detail=str(err)[:160])
    except (LayoutMismatchError, ValueError, RuntimeError, TypeError) as err:
        return Result(arch, caches, "error", detail=f"{type(err).__name__}: {err}"[:160])
    hot, ssd = reused["hot"], reused["ssd"]
    if worst != 0.0:
        outcome = "wrong"
    elif not hot or not ssd:
        outcome = "no reuse"
    else:
        outcome = "pass"
    return Result(arch, caches, outcome, hot, ssd, worst)
