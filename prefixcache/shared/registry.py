"""The live shared prefixes of a PrefixCache, and the counters of shared fetches.

Prefixes are held weakly: a prefix lives while its sequences do (see
prefix.py), and the registry only finds it for the next sequence. The
attention hook is installed while any shared prefix lives (one install per
prefix, undone when the prefix is freed).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import hook
from .prefix import SharedPrefix
from .probe import SharedLayout

if TYPE_CHECKING:
    from ..cache import PrefixCache


@dataclass(slots=True)
class SharedCounters:
    """Counters of ``fetch(shared=True)`` (one PrefixCache)."""

    num_fetches: int = 0
    num_reuses: int = 0  # served from a live prefix: nothing restored, nothing copied
    num_loads: int = 0  # a prefix restored once (one private fetch) and shared from then on
    num_gap_restores: int = 0  # a live prefix plus a private restore of the tokens past it
    num_fallbacks: int = 0  # private copies given instead (the reasons below)
    reused_tokens: int = 0  # tokens served from live prefixes
    fallbacks: dict[str, int] = field(default_factory=dict)


class SharedRegistry:
    """Live shared prefixes by namespace root, the model's shared layout, counters.

    Attributes:
        lock: held around a whole shared fetch.
        layout: the model's SharedLayout, once probed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.layout: SharedLayout | None = None
        self.counters = SharedCounters()
        self._live: dict[bytes, weakref.WeakSet[SharedPrefix]] = {}

    def add(self, prefix: SharedPrefix) -> None:
        """Register a new prefix; the hook stays installed while it lives."""
        self._live.setdefault(prefix.root, weakref.WeakSet()).add(prefix)
        hook.install()
        weakref.finalize(prefix, hook.uninstall)
        self.counters.num_loads += 1

    def best(self, root: bytes, data: bytes) -> tuple[SharedPrefix | None, int]:
        """The live prefix a prompt (``data``, uint32 bytes) can use most of, and how
        many of its tokens: at most all but the prompt's last (the model needs a
        token to give logits); the whole prefix unless it can be cut back."""
        limit = len(data) // 4 - 1
        best, most = None, 0
        for prefix in list(self._live.get(root, ())):
            common = common_tokens(prefix.tokens, data)
            if prefix.trimmable:
                usable = min(common, limit)
            else:
                whole = prefix.num_tokens
                usable = whole if common >= whole and whole <= limit else 0
            if usable > most:
                best, most = prefix, usable
        return best, most

    def live(self) -> list[SharedPrefix]:
        return [p for prefixes in self._live.values() for p in list(prefixes)]

    def reused(self, num_tokens: int) -> None:
        self.counters.num_reuses += 1
        self.counters.reused_tokens += num_tokens

    def fell_back(self, reason: str) -> None:
        self.counters.num_fallbacks += 1
        self.counters.fallbacks[reason] = self.counters.fallbacks.get(reason, 0) + 1

    def stats(self) -> dict[str, object]:
        """Counters (``fallbacks`` flattened to ``num_fallbacks_<reason>``) and what lives now."""
        out: dict[str, object] = asdict(self.counters)
        for reason, n in out.pop("fallbacks").items():
            out[f"num_fallbacks_{reason}"] = n
        live = self.live()
        out["num_prefixes"] = len(live)
        out["prefix_bytes"] = sum(p.nbytes for p in live)
        out["num_sequences"] = sum(p.num_users for p in live)
        return out


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two uint32 token strings share."""
    n = min(len(a), len(b)) // 4
    x = np.frombuffer(a, np.uint32, n)
    y = np.frombuffer(b, np.uint32, n)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if len(differ) else n


_registries: weakref.WeakKeyDictionary[PrefixCache, SharedRegistry] = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def registry_of(pc: PrefixCache, *, create: bool = True) -> SharedRegistry | None:
    """The registry of ``pc`` (made on first use unless ``create`` is False)."""
    with _registries_lock:
        registry = _registries.get(pc)
        if registry is None and create:
            registry = _registries[pc] = SharedRegistry()
        return registry
