"""mlx-lm server adapter: its prompt-cache interface backed by PrefixCache.

mlx-lm's server keeps a RAM-only, whole-prompt ``LRUPromptCache``.
``TieredPromptCache`` answers the same calls from blocks shared between
conversations, hot in RAM and, unless hot-only, on SSD across restarts.
``prefixcache serve`` (cli/serve.py) runs mlx-lm's own ``main()`` with it in place.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .cache import PrefixCache
from .codecs import codec_for
from .config import CacheConfig
from .errors import UnsupportedCacheError
from .model_id import model_fingerprint

log = logging.getLogger(__name__)

# [min, max) of the mlx-lm releases whose server calls this adapter fits (tested: 0.32.2).
SUPPORTED_MLX_LM = ("0.32.2", "0.33")

ModelKey = Hashable  # mlx-lm's (model_path, adapter_path, draft_model_path)


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


class TieredPromptCache:
    """mlx-lm's server prompt cache, backed by one PrefixCache per model key.

    Only the current model key's PrefixCache is open: mlx-lm's server holds one
    model at a time and an open PrefixCache keeps its model alive, so a switch
    closes the previous one (its dirty hot blocks go to SSD first). Blocks are
    namespaced by the model's weights and cache layout, so a restart (or the
    same weights under another path) finds them again.

    Args:
        model_for: model key -> the loaded model (a ``ModelPair`` when the key
            has a draft model).
        config: PrefixCache settings; defaults to ``CacheConfig.from_env()``.

    Raises:
        MlxLmVersionError: the installed mlx-lm is not supported.
    """

    def __init__(
        self, model_for: Callable[[ModelKey], nn.Module], config: CacheConfig | None = None
    ):
        check_mlx_lm_version()
        self.config = config if config is not None else CacheConfig.from_env()
        self._model_for = model_for
        self._lock = threading.RLock()
        self._key: ModelKey | None = None
        self._cache: PrefixCache | None = None
        self._opened = False
        self.num_rejected = 0  # inserts refused (unsupported cache, layout or length)

    # -- mlx-lm's prompt-cache interface ---------------------------------------

    def fetch_nearest_cache(
        self, model_key: ModelKey, tokens: Sequence[int]
    ) -> tuple[list[Any] | None, list[int]]:
        """(cache holding the longest cached prefix or None, tokens still to prefill)."""
        tokens = list(tokens)
        text = _text_prefix(tokens)
        with self._lock:
            cache = self._open(model_key)
            if cache is None or not text:
                return None, tokens
            # only what was restored: the server reports it as cached_tokens
            restored, num_cached = cache.fetch(text)
        if num_cached == 0:
            return None, tokens
        return restored, tokens[num_cached:]

    def insert_cache(
        self,
        model_key: ModelKey,
        tokens: Sequence[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Keep every new full block of ``prompt_cache`` (which holds ``tokens``).

        ``cache_type`` (system / user / assistant) is accepted for the
        interface: blocks are shared, and eviction already drops leaves (the
        conversation tails) before the prefixes they extend.
        """
        with self._lock:
            cache = self._open(model_key)
            text = _text_prefix(tokens)
            if cache is None or not text:
                return
            try:
                cache.store(_held(text, prompt_cache), prompt_cache)
            except (ValueError, UnsupportedCacheError) as err:  # includes LayoutMismatchError
                # Raising here would kill mlx-lm's generation thread: refuse the insert instead.
                self.num_rejected += 1
                level = logging.WARNING if self.num_rejected == 1 else logging.DEBUG
                log.log(level, "prefixcache: %s cache not stored: %s", cache_type, err)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict hot blocks down to ``n_bytes`` (dirty ones spill to SSD).

        Blocks are shared between sequences, so there is no per-sequence unit
        to drop: ``n_sequences=0`` empties the hot tier, other counts keep it.
        """
        limit = None if n_bytes is None else max(0, n_bytes)
        if n_sequences is not None and n_sequences <= 0:
            limit = 0
        with self._lock:
            if limit is not None and self._cache is not None:
                self._cache.trim_hot(limit)

    def __len__(self) -> int:
        """Hot blocks held (the unit of this cache; sequences share them)."""
        with self._lock:
            return len(self._cache.hot) if self._cache is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM by the hot tier."""
        with self._lock:
            return self._cache.hot.nbytes if self._cache is not None else 0

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per tier: ``n_sequences`` (blocks held) and ``n_bytes``, as mlx-lm logs them."""
        with self._lock:
            cache = self._cache
            out = {"hot": {"n_sequences": len(self), "n_bytes": self.nbytes}}
            if cache is not None and cache.ssd is not None:
                ssd = cache.ssd.stats()
                out["ssd"] = {"n_sequences": ssd["num_blocks"], "n_bytes": ssd["nbytes"]}
            return out

    # -- ours --------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """The open PrefixCache's stats plus the adapter's counters."""
        with self._lock:
            out = self._cache.stats() if self._cache is not None else {}
            return {**out, "model_key": self._key, "num_rejected": self.num_rejected}

    def close(self) -> None:
        """Flush and close the open PrefixCache; logs its counters."""
        with self._lock:
            self._close_current()
            self._key, self._opened = None, False

    def __enter__(self) -> TieredPromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, model_key: ModelKey) -> PrefixCache | None:
        if self._opened and model_key == self._key:
            return self._cache
        self._close_current()
        self._key, self._opened = model_key, True
        try:
            model = self._model_for(model_key)
            self._cache = PrefixCache(model, self.config, model_id=_model_id(model_key, model))
        except UnsupportedCacheError as err:
            log.warning("prefixcache: %s is served without a prompt cache: %s", model_key, err)
            return None
        log.info("prefixcache: cache for %s open (%s)", model_key, self._cache.namespace.model_id)
        return self._cache

    def _close_current(self) -> None:
        cache, self._cache = self._cache, None
        if cache is None:
            return
        try:
            cache.flush()
            stats = cache.stats()
        finally:
            cache.close()
        summary = " ".join(f"{k}={stats[k]}" for k in _SUMMARY)
        log.info("prefixcache: closed cache for %s: %s", self._key, summary)


def _model_id(model_key: ModelKey, model: nn.Module) -> str:
    """``path[+adapter][+draft]@fp:...``: readable in ``prefixcache stats``, and
    still the weights' fingerprint, so new weights at the same path never hit."""
    parts = model_key if isinstance(model_key, tuple) else (model_key,)
    name = "+".join(str(p) for p in parts if p)
    return f"{name}@{model_fingerprint(model)}"


_SUMMARY = (
    "num_fetches", "num_hits", "prompt_tokens", "cached_tokens", "hot_block_hits",
    "ssd_block_hits", "stored_blocks", "num_spills",
)  # fmt: skip


def _text_prefix(tokens: Sequence[int]) -> Sequence[int]:
    """The tokens before the first image: mlx-lm keys image patches by negative ids."""
    first = next((i for i, t in enumerate(tokens) if t < 0), None)
    return tokens if first is None else tokens[:first]


def _held(tokens: Sequence[int], prompt_cache: list[Any]) -> Sequence[int]:
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
