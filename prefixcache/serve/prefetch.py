"""Prefetch in mlx-lm's server: a request's cached prefix promoted while it waits.

mlx-lm's HTTP thread hands a request to the generation thread through a queue;
when that thread is busy (a batch decoding, a sequential generation) the
request waits there. ``QueuedPrefetch`` starts ``PrefixCache.prefetch`` of a
request's prompt once it has waited ``PICKUP_SECONDS`` without the generation
thread taking it (``picked``): the lower-tier blocks of its restore move into
hot meanwhile, and the fetch that follows finds them there. A request an idle
generation thread takes at once is not prefetched at all: its fetch follows
within a millisecond, and a prefetch beside it only took cores from it (on 2
cores, TTFT p50 1.17x with nothing queued, tools/bench_prefetch.py). The prompt
is tokenized on a timer thread with a tokenizer of its own (a copy: tokenizers
are not made for two threads at once), and again where mlx-lm always does it;
a prefetch that cannot be made is skipped, never an error.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .fit import ModelKey, cache_key

log = logging.getLogger(__name__)


class Prefetching(Protocol):
    """What this needs of the server's prompt cache (TieredPromptCache)."""

    def prefetch(
        self, model: ModelKey, tokens: list[int], extra: Mapping[str, str] | None = None
    ) -> int: ...


# A request an idle generation thread takes is picked within a millisecond; one
# that waits behind a decode step or a generation waits tens of ms or more.
PICKUP_SECONDS = 0.01


class QueuedPrefetch:
    """Starts the prefetch of a request's prompt if it is still queued after
    ``pickup`` seconds.

    Args:
        tokenize: mlx-lm's own ``_tokenize(tokenizer, request, args)`` (unbound
            of any override), returning its five fields (the prompt first, the
            images last: ``fit.cache_key``).
        prompt_cache: the server's prompt cache.
        pickup: seconds a request may wait before its prefetch starts.
    """

    def __init__(
        self,
        tokenize: Callable[..., tuple],
        prompt_cache: Prefetching,
        pickup: float = PICKUP_SECONDS,
    ):
        self.tokenize = tokenize
        self.prompt_cache = prompt_cache
        self.pickup = pickup
        self._lock = threading.Lock()
        self._own: tuple[ModelKey, Any] | None = None  # (model key, tokenizer copy)
        self._waiting: dict[int, threading.Timer] = {}  # id(request) -> its timer

    def __call__(self, provider: Any, request: Any, args: Any, extra: Any) -> None:
        """The request is queued: prefetch its prompt unless it is picked first."""
        timer = threading.Timer(self.pickup, self._start, (provider, request, args, extra))
        timer.daemon = True
        timer.name = "prefixcache-prefetch-timer"
        with self._lock:
            self._waiting[id(request)] = timer
        timer.start()

    def picked(self, request: Any) -> None:
        """The generation thread took the request: its prefetch is not started now."""
        with self._lock:
            timer = self._waiting.pop(id(request), None)
        if timer is not None:
            timer.cancel()

    def _start(self, provider: Any, request: Any, args: Any, extra: Any) -> int:
        with self._lock:
            if self._waiting.pop(id(request), None) is None:
                return 0  # picked meanwhile
        return self.prefetch(provider, request, args, extra)

    def prefetch(self, provider: Any, request: Any, args: Any, extra: Any) -> int:
        """Blocks queued for the request's prompt (0: none, or no prefetch possible)."""
        key = getattr(provider, "model_key", None)
        if getattr(provider, "model", None) is None or key is None:
            return 0  # no model loaded yet: nothing is known of the prompt
        try:
            prompt = cache_key(self.tokenize(self._tokenizer(provider, key), request, args))
        except Exception as err:  # mlx-lm reports a bad request where it tokenizes it
            log.debug("prefixcache: no prefetch for a request: %s", err)
            return 0
        if not isinstance(prompt, list):
            return 0
        return self.prompt_cache.prefetch(key, prompt, extra)

    def _tokenizer(self, provider: Any, key: ModelKey) -> Any:
        with self._lock:
            if self._own is None or self._own[0] != key:
                self._own = (key, copy.deepcopy(provider.tokenizer))
            return self._own[1]
