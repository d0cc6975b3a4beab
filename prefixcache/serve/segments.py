"""Checkpoints in mlx-lm's server: where its prefill stops so the cache keeps state there.

mlx-lm's server inserts a request's cache into the prompt cache at the end of
each prompt segment (system | user | a short tail; its batched path) and once
generation ends. On layouts whose state cannot be cut back (recurrent layers,
windows, chunks: ``PrefixCache.checkpoints``) those are the only points a
later request can resume from. So:

- the batched path: the segments its tokenizer step makes are cut again at
  the prompt's checkpoints (``cut_segments``), so its own end-of-segment
  inserts keep the state there;
- the sequential path (``stream_generate``, used for KV quantization, seeds,
  images): ``CheckpointedPrefill`` prefills the prompt (its image rows too)
  up to each checkpoint in mlx-lm's chunks, inserts the cache there, and
  hands the rest to mlx-lm's own loop. A checkpoint inside an image moves to
  the image's first patch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from .fit import ModelKey, ModelPair
from .images import image_start


def cut_segments(
    segments: Sequence[Sequence[int]], types: Sequence[str], cuts: Sequence[int]
) -> tuple[list[list[int]], list[str]]:
    """mlx-lm's prompt ``segments`` (and their ``types``) cut again at the absolute
    token positions ``cuts``; a piece keeps the type of the segment it comes from."""
    out: list[list[int]] = []
    out_types: list[str] = []
    start = 0
    for segment, kind in zip(segments, types, strict=True):
        end = start + len(segment)
        bounds = [start, *sorted(c for c in set(cuts) if start < c < end), end]
        for a, b in itertools.pairwise(bounds):
            out.append(list(segment[a - start : b - start]))
            out_types.append(kind)
        start = end
    return out, out_types


class Checkpoints(Protocol):
    """What the sequential path needs of the server's prompt cache (TieredPromptCache)."""

    def last_fetch(self) -> tuple[ModelKey, list[int], int] | None: ...

    def checkpoints(self, model: ModelKey, tokens: Sequence[int], num_cached: int) -> list[int]: ...

    def insert_cache(
        self, model: ModelKey, tokens: Sequence[int], prompt_cache: list[Any]
    ) -> None: ...


class CheckpointedPrefill:
    """``stream_generate`` for mlx-lm's sequential path: the prompt is prefilled up to
    each checkpoint first (in ``prefill_step_size`` chunks, KV quantized as mlx-lm
    does), with the cache inserted there; mlx-lm's loop does the rest.

    Args:
        stream_generate: mlx-lm's own function.
        prompt_cache: the server's prompt cache.
    """

    def __init__(self, stream_generate: Callable[..., Iterator[Any]], prompt_cache: Checkpoints):
        self.stream_generate = stream_generate
        self.prompt_cache = prompt_cache

    def __call__(self, model: Any, tokenizer: Any, prompt: Any, *args: Any, **kwargs: Any):
        cache = kwargs.get("prompt_cache")
        last = self.prompt_cache.last_fetch()
        if cache is None or last is None:
            return self.stream_generate(model, tokenizer, prompt, *args, **kwargs)
        key, tokens, num_cached = last
        prompt = list(prompt)
        if not _is_rest(prompt, tokens[num_cached:]):  # not the prompt of that fetch
            return self.stream_generate(model, tokenizer, prompt, *args, **kwargs)
        draft = kwargs.get("draft_model")
        runner = ModelPair(model, draft) if draft is not None else model
        embeddings = kwargs.get("input_embeddings")  # (len(prompt), hidden): images
        stream = kwargs.get("stream")
        start = num_cached
        with mx.stream(stream) if stream is not None else nullcontext():
            stops = self.prompt_cache.checkpoints(key, tokens, start)
            for stop in _outside_images(stops, tokens, start):
                rows = None if embeddings is None else embeddings[num_cached - start : stop - start]
                _prefill(runner, tokens[num_cached:stop], cache, kwargs, rows)
                self.prompt_cache.insert_cache(key, tokens[:stop], cache)
                num_cached = stop
        if embeddings is not None:
            kwargs["input_embeddings"] = embeddings[num_cached - start :]
        return self.stream_generate(model, tokenizer, prompt[num_cached - start :], *args, **kwargs)


def _is_rest(prompt: Sequence[int], key: Sequence[int]) -> bool:
    """``prompt`` is the rest ``key`` left to prefill (an image's patches: negative in
    ``key``, the image token in ``prompt``)."""
    if len(prompt) != len(key):
        return False
    return all(p == k for p, k in zip(prompt, key, strict=True) if k >= 0)


def _outside_images(stops: Sequence[int], key: Sequence[int], start: int) -> list[int]:
    """``stops`` moved to the first patch of an image they fall inside (a restore never
    ends inside an image: images.py), those past ``start``."""
    return sorted({s for s in (image_start(key, stop) for stop in stops) if s > start})


def _prefill(
    model: Any, tokens: Sequence[int], cache: list[Any], options: dict, embeddings: Any = None
) -> None:
    """``tokens`` (or their ``embeddings`` rows) through ``model`` in mlx-lm's prefill
    chunks, quantizing as it does."""
    step = options.get("prefill_step_size", 2048)
    bits, group = options.get("kv_bits"), options.get("kv_group_size", 64)
    start_q = options.get("quantized_kv_start", 0)
    for start in range(0, len(tokens), step):
        inputs = mx.array([tokens[start : start + step]])
        if embeddings is None:
            model(inputs, cache=cache)
        else:  # the model embeds nothing itself: mlx-lm's prefill passes both
            model(inputs, cache=cache, input_embeddings=embeddings[start : start + step][None])
        maybe_quantize_kv_cache(cache, start_q, group, bits)
        mx.eval([c.state for c in cache])
