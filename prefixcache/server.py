"""mlx-lm server adapter: its prompt-cache interface backed by PrefixCache, and ``serve``.

mlx-lm's server keeps a RAM-only, whole-prompt ``LRUPromptCache``.
``TieredPromptCache`` answers the same calls from blocks shared between
conversations, hot in RAM and, unless hot-only, on SSD across restarts.
``prefixcache serve`` runs mlx-lm's own ``main()`` with it in place.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .codecs import UnsupportedCacheError, codec_for
from .config import ENV_PREFIX, WRITE_POLICIES, CacheConfig, parse_bytes
from .manager import PrefixCache
from .metrics import serve_metrics

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
            if cache.layout.needs_capture:
                restored, num_cached = _fetch_extended(cache, text)
            else:
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
            self._cache = PrefixCache(self._model_for(model_key), self.config)
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


def _fetch_extended(cache: PrefixCache, text: list[int]) -> tuple[list[Any], int]:
    """Fetch, then prefill up to the last block boundary here, capturing each block.

    Window and recurrent state exist only while prefilling and mlx-lm's prefill
    does not hand them out, so for such models the block-aligned part of the
    prompt is prefilled by ``PrefixCache.prefill``; the server prefills the rest.
    """
    bs = cache.config.block_size
    aligned = (len(text) - 1) // bs * bs
    if aligned == 0:
        return cache.fetch(text)
    restored, _ = cache.prefill(text[:aligned])
    return restored, aligned


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


def provider_models(provider: Any) -> Callable[[ModelKey], nn.Module]:
    """``model_for`` over mlx-lm's ``ModelProvider`` (the model it has loaded)."""

    def model_for(model_key: ModelKey) -> nn.Module:
        if provider.model_key != model_key:
            raise ValueError(f"model {model_key} is not loaded (loaded: {provider.model_key})")
        if provider.draft_model is not None:
            return ModelPair(provider.model, provider.draft_model)
        return provider.model

    return model_for


# -- prefixcache serve -----------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s options; every option it does not know goes to mlx_lm.server."""
    parser.description = "mlx-lm's OpenAI-compatible server with the tiered prefix cache."
    parser.epilog = (
        "Every other option is mlx_lm.server's and is passed to it unchanged (--host, "
        "--port, --max-tokens, --prompt-cache-bytes, --kv-bits, ...: see `mlx_lm.server "
        "--help`). --prompt-cache-bytes trims the hot tier as it trims mlx-lm's cache; "
        "--prompt-cache-size has no effect (blocks are shared, not counted per sequence). "
        "SIGINT/SIGTERM flush the hot tier to SSD before exiting."
    )
    parser.add_argument("--model", required=True, help="model path or repo (mlx_lm.server's)")
    group = parser.add_argument_group("prefix cache (defaults from PREFIXCACHE_* variables)")
    group.add_argument("--ssd-dir", help="SSD tier directory")
    group.add_argument("--hot-max-bytes", type=parse_bytes, help="RAM budget, e.g. 8G")
    group.add_argument("--ssd-max-bytes", type=parse_bytes, help="SSD budget, e.g. 64G")
    group.add_argument("--block-size", type=int, help="tokens per block")
    group.add_argument("--hot-cache-only", action="store_true", default=None, help="no SSD tier")
    group.add_argument("--write-policy", choices=WRITE_POLICIES)
    group.add_argument("--metrics-port", type=int, help="Prometheus text at 127.0.0.1:PORT/metrics")
    parser.allow_abbrev = False  # "--host" must not be taken for a prefix of ours
    parse_known = parser.parse_known_args

    def keep_unknown(args=None, namespace=None):
        # argparse would reject unknown options at the top level: keep them for mlx-lm.
        ns, rest = parse_known(args, namespace)
        ns.mlx_lm_args = [*getattr(ns, "mlx_lm_args", []), *rest]
        return ns, []

    parser.parse_known_args = keep_unknown  # type: ignore[method-assign]


_CONFIG_FLAGS = (
    "ssd_dir", "hot_max_bytes", "ssd_max_bytes", "block_size", "hot_cache_only", "write_policy",
)  # fmt: skip


def serve_config(args: argparse.Namespace) -> CacheConfig:
    """CacheConfig from ``serve``'s options over ``PREFIXCACHE_*`` variables.

    ``restore_headroom`` defaults to 0: the batch path copies a restored cache
    into its batch at once, so headroom would only be allocated and dropped.
    """
    config = CacheConfig.from_env(**{name: getattr(args, name, None) for name in _CONFIG_FLAGS})
    if ENV_PREFIX + "RESTORE_HEADROOM" not in os.environ:
        config = config.replace(restore_headroom=0)
    return config


def run_serve(args: argparse.Namespace) -> int:
    """Run mlx-lm's server (its ``main()``) with a TieredPromptCache in place."""
    try:
        check_mlx_lm_version()
    except MlxLmVersionError as err:
        print(f"prefixcache serve: {err}", file=sys.stderr)
        return 2
    from mlx_lm import server

    config = serve_config(args)
    generators: list[Any] = []
    argv = ["prefixcache serve", "--model", args.model, *getattr(args, "mlx_lm_args", [])]
    generator_class = _generator_class(server.ResponseGenerator, config, generators)
    with (
        _swapped(server, "ResponseGenerator", generator_class),
        _swapped(sys, "argv", argv),
        _sigterm_interrupts(),
        serve_metrics(
            args.metrics_port, lambda: generators[-1].tiered.stats() if generators else {}
        ),
    ):
        try:
            server.main()
        finally:
            for generator in generators:  # idempotent: mlx-lm's shutdown did it already
                generator.stop_and_join()
    return 0


def _generator_class(base: type, config: CacheConfig, made: list[Any]) -> type:
    """mlx-lm's ResponseGenerator with our cache swapped in through its constructor."""

    class TieredResponseGenerator(base):  # type: ignore[misc,valid-type]
        def __init__(self, model_provider: Any, prompt_cache: Any):
            del prompt_cache  # the empty LRUPromptCache mlx-lm's run() made
            cli = model_provider.cli_args
            kv = {"kv_bits": cli.kv_bits, "kv_group_size": cli.kv_group_size}
            cfg = config.replace(**kv, quantized_kv_start=cli.quantized_kv_start)
            self.tiered = TieredPromptCache(provider_models(model_provider), cfg)
            made.append(self)
            super().__init__(model_provider, self.tiered)

        def stop_and_join(self) -> None:
            try:
                super().stop_and_join()
            finally:
                self.tiered.close()

    return TieredResponseGenerator


@contextmanager
def _swapped(owner: object, name: str, value: object) -> Iterator[None]:
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the server as Ctrl-C does: mlx-lm's shutdown path, then our flush."""

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM exits at once
        log.info("prefixcache serve: SIGTERM, shutting down")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
