"""Prefetch in mlx-lm's server: a request's cached prefix promoted while it waits.

mlx-lm's HTTP thread hands a request to the generation thread through a queue;
when that thread is busy (a batch decoding, a sequential generation) the
request waits there. ``QueuedPrefetch`` tokenizes the request on the HTTP
thread, with a tokenizer of its own (a copy: tokenizers are not made for two
threads at once), and starts ``PrefixCache.prefetch`` of its prompt: the
lower-tier blocks of its restore move into hot meanwhile, and the fetch that
follows finds them there. The request is tokenized again where mlx-lm always
does it; a prefetch that cannot be made is skipped, never an error.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .mlx_fit import ModelKey

log = logging.getLogger(__name__)


class Prefetching(Protocol):
    """What this needs of the server's prompt cache (TieredPromptCache)."""

    def prefetch(
        self, model: ModelKey, tokens: list[int], extra: Mapping[str, str] | None = None
    ) -> int: ...


class QueuedPrefetch:
    """Starts the prefetch of a request's prompt from the thread that queues it.

    Args:
        tokenize: mlx-lm's own ``_tokenize(tokenizer, request, args)`` (unbound
            of any override), returning the prompt first.
        prompt_cache: the server's prompt cache.
    """

    def __init__(self, tokenize: Callable[..., tuple], prompt_cache: Prefetching):
        self.tokenize = tokenize
        self.prompt_cache = prompt_cache
        self._lock = threading.Lock()
        self._own: tuple[ModelKey, Any] | None = None  # (model key, tokenizer copy)

    def __call__(self, provider: Any, request: Any, args: Any, extra: Any) -> int:
        """Blocks queued for the request's prompt (0: none, or no prefetch possible)."""
        key = getattr(provider, "model_key", None)
        if getattr(provider, "model", None) is None or key is None:
            return 0  # no model loaded yet: nothing is known of the prompt
        try:
            prompt = self.tokenize(self._tokenizer(provider, key), request, args)[0]
        except Exception as err:  # mlx-lm reports a bad request where it tokenizes it
            log.debug("prefixcache: no prefetch for a request: %s", err)
            return 0
        if not isinstance(prompt, list) or any(t < 0 for t in prompt):
            return 0  # images: the cache key is not the prompt
        return self.prompt_cache.prefetch(key, prompt, extra)

    def _tokenizer(self, provider: Any, key: ModelKey) -> Any:
        with self._lock:
            if self._own is None or self._own[0] != key:
                self._own = (key, copy.deepcopy(provider.tokenizer))
            return self._own[1]
