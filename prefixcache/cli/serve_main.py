"""``prefixcache serve``'s run: mlx-lm's own server ``main()`` with TieredPromptCache in place.

mlx-lm builds ``ResponseGenerator(model_provider, prompt_cache)``; for the
duration of the call that class is swapped for a subclass that passes a
``TieredPromptCache`` instead and flushes it on shutdown. Argument parsing,
model loading, batching and HTTP stay mlx-lm's. SIGTERM takes mlx-lm's Ctrl-C
path, so the hot tier is flushed to SSD either way. Imported only to serve
(it imports mlx-lm); the options are serve.py's.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.nn as nn
from mlx_lm import server

from ..config import CacheConfig
from ..mlx_fit import ModelKey, ModelPair
from ..mlx_server import TieredPromptCache
from .metrics import serve_metrics

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
) -> int:
    """Run mlx-lm's server ``main()`` on ``model`` (and its own options) with our cache
    (``shared``: concurrent requests on one prefix hold it once)."""
    generators: list[Any] = []
    argv = ["prefixcache serve", "--model", model, *mlx_lm_args]
    generator_class = _generator_class(server.ResponseGenerator, config, generators, shared)
    with (
        _swapped(server, "ResponseGenerator", generator_class),
        _swapped(sys, "argv", argv),
        _sigterm_interrupts(),
        serve_metrics(metrics_port, lambda: generators[-1].tiered.stats() if generators else {}),
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
            cli = model_provider.cli_args
            kv = {"kv_bits": cli.kv_bits, "kv_group_size": cli.kv_group_size}
            cfg = config.replace(**kv, quantized_kv_start=cli.quantized_kv_start)
            self.tiered = TieredPromptCache(provider_models(model_provider), cfg, shared=shared)
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
