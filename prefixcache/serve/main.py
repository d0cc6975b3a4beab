"""``prefixcache serve``'s run: mlx-lm's own server ``main()`` with TieredPromptCache in place.

mlx-lm builds ``ResponseGenerator(model_provider, prompt_cache)``; for the
duration of the call that class is swapped for a subclass that passes a
``TieredPromptCache`` instead and flushes it on shutdown, and cuts the
prompt's segments again at its checkpoints; its ``stream_generate`` (the
sequential path) prefills up to each checkpoint first (segments.py).
Argument parsing, model loading, batching and HTTP stay mlx-lm's. SIGTERM
takes mlx-lm's Ctrl-C path, so the hot tier is flushed to SSD either way.
Imported only to serve (it imports mlx-lm); the options are cli/serve.py's.
With ``--events-url`` the default model's cache opens as soon as the model is
loaded, so the KV-events publisher listens before the first request.

The generator subclass builds on generator.py's (its loop supervised, each
prompt checked) and the HTTP handler is handler.py's (each request checked
first: no request a client sends stops the server). Per-request cache fields
(``cache_salt``, ``session_id`` / ``X-Session-Id``, ``cache.persist``) reach
the cache through three narrow overrides (request_options.py,
docs/operating.md): the HTTP handler parses them before mlx-lm's
``handle_completion`` (a bad one is a 400 naming it), ``generate`` (same
thread) files them under the request object, and ``_tokenize`` (the
generation thread, just before the fetch) registers them with the prompt. With
``--record-trace`` the base generator is the recorder's (recorder.py), which
writes each request's Mooncake line when its reply ends.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.nn as nn
from mlx_lm import server

from ..config import CacheConfig
from .explain import explained
from .fit import ModelKey, ModelPair, cache_key
from .generator import GuardedGenerator
from .handler import CLIENT_TIMEOUT, asked, configured
from .info import server_info
from .metrics import serve_metrics
from .prefetch import QueuedPrefetch
from .prompt_cache import TieredPromptCache
from .recorder import TraceRecorder
from .request_options import DEFAULT, RequestOptions
from .segments import CheckpointedPrefill, cut_segments
from .validate import Limits

log = logging.getLogger(__name__)


def provider_models(provider: Any) -> Callable[[ModelKey], nn.Module]:
    """``model_for`` over mlx-lm's ``ModelProvider`` (the model it has loaded)."""

    def model_for(model_key: ModelKey) -> nn.Module:
        if provider.model_key != model_key:
            raise ValueError(f"model {model_key} is not loaded (loaded: {provider.model_key})")
        if provider.draft_model is not None:
            return ModelPair(provider.model, provider.draft_model)
        return provider.model

    return model_for


def run_mlx_server(
    model: str,
    mlx_lm_args: list[str],
    config: CacheConfig,
    metrics_port: int | None,
    *,
    shared: bool = False,
    limits: Limits | None = None,
    client_timeout: float = CLIENT_TIMEOUT,
    tenant_header: str | None = None,
    recorder: TraceRecorder | None = None,
) -> int:
    """Run mlx-lm's server ``main()`` on ``model`` (and its own options) with our cache
    (``shared``: concurrent requests on one prefix hold it once); requests are checked
    against ``limits`` (handler.py), a client silent for ``client_timeout`` seconds
    is disconnected; ``tenant_header`` names a request's tenant (tenant shares);
    ``recorder`` writes each request's trace line (recorder.py)."""
    generators: list[Any] = []
    argv = ["prefixcache serve", "--model", model, *mlx_lm_args]
    base = GuardedGenerator if recorder is None else recorder.recording(GuardedGenerator)
    generator_class = _generator_class(base, config, generators, shared)
    run_http = server._run_http_server
    info = server_info(config, model)
    handler = configured(limits or Limits(), client_timeout, info, tenant_header)
    with (
        _swapped(server, "ResponseGenerator", generator_class),
        _swapped(server, "stream_generate", _sequential(server.stream_generate, generators)),
        _swapped(server, "_run_http_server", lambda *a, **k: run_http(*a, handler_class=handler)),
        _swapped(sys, "argv", argv),
        _sigterm_interrupts(),
        serve_metrics(metrics_port, lambda: generators[-1].stats() if generators else {}),
    ):
        try:
            server.main()
        finally:
            for generator in generators:  # idempotent: mlx-lm's shutdown did it already
                generator.stop_and_join()
    return 0


def _generator_class(base: type, config: CacheConfig, made: list[Any], shared: bool) -> type:
    """mlx-lm's ResponseGenerator with our cache swapped in through its constructor."""

    class TieredResponseGenerator(base):  # type: ignore[misc,valid-type]
        def __init__(self, model_provider: Any, prompt_cache: Any):
            del prompt_cache  # the empty LRUPromptCache mlx-lm's run() made
            cfg = _with_kv(config, model_provider.cli_args)
            self.tiered = TieredPromptCache(provider_models(model_provider), cfg, shared=shared)
            self._options, self._options_lock = dict[int, RequestOptions](), threading.Lock()
            self._prefetch = QueuedPrefetch(base._tokenize.__get__(self), self.tiered)
            _open_on_load(model_provider, self.tiered, config.events_url)
            made.append(self)
            super().__init__(model_provider, self.tiered)

        def generate(self, request: Any, generation_args: Any, progress_callback: Any = None):
            options = asked.options  # set by the handler on this thread
            with self._options_lock:
                self._options[id(request)] = options  # the request lives until answered
            # if it waits in mlx-lm's queue, its cached prefix moves into hot meanwhile
            self._prefetch(self.model_provider, request, generation_args, options.extra)
            got = super().generate(request, generation_args, progress_callback)
            return explained(self, request, generation_args, got)

        def _tokenize(self, tokenizer: Any, request: Any, args: Any):
            self._prefetch.picked(request)  # taken: no prefetch if none has started
            out = super()._tokenize(tokenizer, request, args)
            with self._options_lock:
                options = self._options.pop(id(request), DEFAULT)
            prompt, segments, kinds = out[0], out[1], out[2]
            if config.pin_system_prompts and kinds[:1] == ["system"] and len(segments) > 1:
                options = dataclasses.replace(options, pin_tokens=len(segments[0]))
            key = cache_key(out)  # images: mlx-lm fetches and inserts by their ids
            self.tiered.requests.begin(key, options)
            cuts = self.tiered.checkpoints(self.model_provider.model_key, key)
            if cuts:  # its batched path inserts the cache at each segment's end
                segments, kinds = cut_segments(segments, kinds, cuts)
            return (prompt, segments, kinds, *out[3:])

        def stats(self) -> dict[str, object]:
            """The cache's stats and the server's guard counters (restarts, refusals)."""
            return {**self.tiered.stats(), **self.guard_stats()}

        def stop_and_join(self) -> None:
            try:
                super().stop_and_join()
            finally:
                self.tiered.close()

    return TieredResponseGenerator


def _with_kv(config: CacheConfig, cli: Any) -> CacheConfig:
    """``config`` with mlx-lm's K/V quantization flags (``--kv-bits`` ...)."""
    kv = {"kv_bits": cli.kv_bits, "kv_group_size": cli.kv_group_size}
    return config.replace(**kv, quantized_kv_start=cli.quantized_kv_start)


def _open_on_load(provider: Any, tiered: TieredPromptCache, events_url: str | None) -> None:
    """With KV events, open the default model's cache as soon as the generation thread
    loads it: the publisher then listens (on the port ``/server_info`` names) before the
    first request stores a block, so a subscriber started with the server misses none."""
    if events_url is None:
        return
    load_default = provider.load_default

    def load_and_open() -> None:
        load_default()
        if provider.model_key is not None:
            tiered.fetch_nearest_cache(provider.model_key, [])  # no tokens: opens, fetches none

    provider.load_default = load_and_open


def _sequential(stream_generate: Callable[..., Any], made: list[Any]) -> Callable[..., Any]:
    """mlx-lm's ``stream_generate`` for its sequential path, prefilling up to each
    checkpoint first (with the cache inserted there)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not made:
            return stream_generate(*args, **kwargs)
        return CheckpointedPrefill(stream_generate, made[-1].tiered)(*args, **kwargs)

    return run


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
