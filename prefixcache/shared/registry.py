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

from ..hashing import TOKEN_BYTES
from . import hook
from .prefix import SharedPrefix
from .probe import SharedLayout

if TYPE_CHECKING:
    from ..cache.prefix_cache import PrefixCache


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
        lock: held around a whole shared fetch (which calls into the PrefixCache).
        layout: the model's SharedLayout, once probed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.layout: SharedLayout | None = None
        # the live prefixes and counters; never held while calling out, so stats()
        # (called under the PrefixCache's lock) cannot wait on a fetch in progress
        self._state = threading.Lock()
        self._counters = SharedCounters()
        self._live: dict[bytes, weakref.WeakSet[SharedPrefix]] = {}

    def add(self, prefix: SharedPrefix) -> None:
        """Register a new prefix; the hook stays installed while it lives."""
        hook.install()
        weakref.finalize(prefix, hook.uninstall)
        with self._state:
            self._live.setdefault(prefix.root, weakref.WeakSet()).add(prefix)
            self._counters.num_loads += 1

    def best(self, root: bytes, data: bytes) -> tuple[SharedPrefix | None, int]:
        """The live prefix a prompt (``data``, uint32 bytes) can use most of, and how
        many of its tokens: at most all but the prompt's last (the model needs a
        token to give logits); the whole prefix unless it can be cut back."""
        limit = len(data) // TOKEN_BYTES - 1
        best, most = None, 0
        with self._state:
            prefixes = list(self._live.get(root, ()))
        for prefix in prefixes:
            common = common_tokens(prefix.tokens, data)
            if prefix.trimmable:
                usable = min(common, limit)
            else:
                whole = prefix.num_tokens
                usable = whole if common >= whole and whole <= limit else 0
            if usable > most:
                best, most = prefix, usable
        return best, most

    def count(self, *, gap: bool = False, reused: int | None = None) -> None:
        """One shared fetch (``gap``: past a live prefix; ``reused``: tokens of one)."""
        with self._state:
            self._counters.num_fetches += 1
            self._counters.num_gap_restores += gap
            if reused is not None:
                self._counters.num_reuses += 1
                self._counters.reused_tokens += reused

    def fell_back(self, reason: str) -> None:
        with self._state:
            self._counters.num_fetches += 1
            self._counters.num_fallbacks += 1
            fallbacks = self._counters.fallbacks
            fallbacks[reason] = fallbacks.get(reason, 0) + 1

    def stats(self) -> dict[str, object]:
        """Counters (``fallbacks`` flattened to ``num_fallbacks_<reason>``) and what lives now."""
        with self._state:
            out: dict[str, object] = asdict(self._counters)
            live = [p for prefixes in self._live.values() for p in list(prefixes)]
        for reason, n in out.pop("fallbacks").items():
            out[f"num_fallbacks_{reason}"] = n
        out["num_prefixes"] = len(live)
        out["prefix_bytes"] = sum(p.nbytes for p in live)
        out["num_sequences"] = sum(p.num_users for p in live)
        return out


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two uint32 token strings share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
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
