"""What the adapter fits of mlx-lm's server: its versions, model keys, draft pairs, tokens.

mlx-lm's server hands the prompt cache a model key, the prompt's tokens (image
patches as negative ids) and, after generating, the request's cache (with a
draft model's layers after the model's under speculative decoding).
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Hashable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..cache.model_id import model_fingerprint
from ..codecs import codec_for

ModelKey = Hashable  # mlx-lm's (model_path, adapter_path, draft_model_path)

# [min, max) of the mlx-lm releases whose server calls this adapter fits (tested: 0.32.2).
SUPPORTED_MLX_LM = ("0.32.2", "0.33")


class MlxLmVersionError(RuntimeError):
    """The installed mlx-lm's server does not have the interface this adapter fits."""


def check_mlx_lm_version(version: str | None = None) -> str:
    """The installed (or given) mlx-lm version; MlxLmVersionError if it is not supported."""
    if version is None:
        version = importlib.metadata.version("mlx-lm")
    low, high = SUPPORTED_MLX_LM
    if not _release(low) <= _release(version) < _release(high):
        raise MlxLmVersionError(
            f"prefixcache's server adapter supports mlx-lm >={low},<{high} "
            f"(the prompt-cache calls of mlx_lm.server), but mlx-lm {version} is installed; "
            f"install a supported one: pip install 'mlx-lm>={low},<{high}'"
        )
    return version


def _release(version: str) -> tuple[int, ...]:
    """(0, 32, 2, 0) from "0.32.2", "0.32.2.dev1" or "0.32.2rc1"; (0, 33, 0, 0) from "0.33"."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("rc")[0].split(".dev")[0])]
    return tuple([*parts, 0, 0, 0, 0][:4])


class ModelPair(nn.Module):
    """A model and its draft as one cache list, model layers first (mlx-lm's speculative)."""

    def __init__(self, model: nn.Module, draft: nn.Module):
        super().__init__()
        self.model = model
        self.draft = draft
        self.num_model_layers = len(make_prompt_cache(model))

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model) + make_prompt_cache(self.draft)

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        n = self.num_model_layers
        self.draft(inputs, cache=cache[n:])
        return self.model(inputs, cache=cache[:n])


def cache_key(tokenized: tuple[Any, ...]) -> list[int]:
    """The tokens mlx-lm's server fetches and inserts a request's cache by, from its
    ``_tokenize``'s result: the prompt, or its ``Vision.cache_key`` (images)."""
    vision = tokenized[4]
    return vision.cache_key if vision is not None else tokenized[0]


def held_tokens(tokens: Sequence[int], prompt_cache: list[Any]) -> Sequence[int]:
    """The tokens every layer holds (the cache is ours once inserted, so it may be trimmed).

    Speculative decoding leaves the last token unfed and the draft's layers
    one token apart from the model's: layers holding more than the others, or
    more than ``tokens``, are trimmed, and the token list is cut to match.
    """
    lengths = [codec_for(c).length(c) for c in prompt_cache]
    held = min([n for n in lengths if n is not None] + [len(tokens)])
    for layer, length in zip(prompt_cache, lengths, strict=True):
        if length is not None and length > held and layer.is_trimmable():
            layer.trim(length - held)
    return tokens[:held] if held < len(tokens) else tokens


def model_id_of(model_key: ModelKey, model: nn.Module) -> str:
    """``path[+adapter][+draft]@fp:...``: readable in ``prefixcache stats``, and
    still the weights' fingerprint, so new weights at the same path never hit."""
    parts = model_key if isinstance(model_key, tuple) else (model_key,)
    name = "+".join(str(p) for p in parts if p)
    return f"{name}@{model_fingerprint(model)}"
