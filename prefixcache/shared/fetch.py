"""``PrefixCache.fetch(shared=True)``: a live shared prefix, or the private restore
handed to the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .registry import SharedRegistry


def fetch_shared(
    registry: SharedRegistry,
    data: bytes,
    root: Callable[[], bytes],
    fetch: Callable[[], tuple[list[Any], int]],
    match: Callable[[], int],
) -> tuple[list[Any], int]:
    """A live shared prefix covering at least what the tiers would restore is used as
    is (nothing restored or copied); else the private restore is handed to the
    registry (a new shared prefix, or the suffix of a live one); the private fetch
    where the model cannot share.

    Args:
        registry: the cache's shared prefixes.
        data: the prompt's tokens as uint32 bytes.
        root, fetch, match: the prompt's namespace root key; the cache's private
            ``fetch`` and ``match`` of the prompt.
    """
    with registry.lock:
        reason = registry.unavailable()
        if reason is not None:
            registry.fell_back(reason)
            return fetch()
        key = root()
        live, usable = registry.live(key, data)
        if live is not None and usable >= match():
            return registry.reuse(live, usable), usable
        restored, num_cached = fetch()
        return registry.adopt(key, data, restored, num_cached, live, usable)
