"""The attention hook: mlx-lm's ``scaled_dot_product_attention`` routed to shared caches.

Every mlx-lm model computes attention through
``mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values,
cache, scale, mask, sinks=None)``, and most bind that function into their own
module at import (``from .base import scaled_dot_product_attention``), so
replacing it in ``base`` alone would miss them. :func:`install` replaces the
name in every loaded module whose global of that name *is* mlx-lm's function
(and nothing else); the replacement hands a call whose ``cache`` is a
:class:`SharedAttention` (the base of every shared cache) to its ``attend``
(the one method the hook calls, declared on that class) and passes every
other call to the original unchanged. :func:`uninstall` puts the original
back wherever the replacement is found, modules imported in between included,
so the state after it is exactly the state before. Installs are counted: the
hook stays while any holder (a live shared prefix, a :func:`hooked` block)
needs it.

A model that computes attention without that function (gemma2 does its own,
for logit soft-capping) is not hooked: its shared layers never reach
``attend`` (``SharedAttention.num_attends`` stays 0, which the probe checks),
and ``fetch`` serves it private copies instead.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import _BaseCache


class SharedAttention(_BaseCache, ABC):
    """A layer cache whose attention the hook hands to ``attend``.

    Attributes:
        num_attends: attentions computed by ``attend`` (the probe reads it).
        num_dense: attentions left to mlx-lm (the model changed the keys it fetched).
    """

    def __init__(self) -> None:
        self.num_attends = 0
        self.num_dense = 0
        self._fetched: Any = None  # the keys update_and_fetch returned last

    def attend(
        self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any, sinks: Any
    ) -> mx.array | None:
        """The attention output, or None when ``keys`` are not what this cache
        returned last (then mlx-lm computes it from ``keys``, unshared)."""
        fetched, self._fetched = self._fetched, None
        if fetched is None or keys is not fetched:
            self.num_dense += 1
            return None
        self.num_attends += 1
        return self._attend(queries, scale, mask, sinks)

    @abstractmethod
    def _attend(self, queries: mx.array, scale: float, mask: Any, sinks: Any) -> mx.array:
        """The attention over this cache's keys (shared prefix and private suffix)."""

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return False


NAME = "scaled_dot_product_attention"
ORIGINAL = base.scaled_dot_product_attention

_lock = threading.Lock()
_holders = 0


def shared_sdpa(
    queries: Any,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> Any:
    """mlx-lm's attention, split over a shared prefix when ``cache`` holds one."""
    if isinstance(cache, SharedAttention):
        out = cache.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if out is not None:
            return out
    return ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _rebind(old: object, new: object) -> int:
    """Set ``NAME`` to ``new`` in every loaded module where it is ``old``; how many."""
    count = 0
    for module in list(sys.modules.values()):
        # a module's own namespace, not getattr: lazy modules must not be triggered
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(NAME) is old:
            namespace[NAME] = new
            count += 1
    return count


def install() -> None:
    """Route mlx-lm's attention through shared caches (counted; see :func:`uninstall`)."""
    global _holders
    with _lock:
        if _holders == 0:
            _rebind(ORIGINAL, shared_sdpa)
        _holders += 1


def uninstall() -> None:
    """Drop one :func:`install`; the last one restores mlx-lm's function everywhere.

    Raises:
        RuntimeError: more uninstalls than installs.
    """
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("uninstall() without a matching install()")
        _holders -= 1
        if _holders == 0:
            _rebind(shared_sdpa, ORIGINAL)


def installed() -> bool:
    """Whether the hook is in place."""
    with _lock:
        return _holders > 0


@contextlib.contextmanager
def hooked() -> Iterator[None]:
    """The hook installed for the block (on top of any other holder)."""
    install()
    try:
        yield
    finally:
        uninstall()
