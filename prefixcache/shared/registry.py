"""The live shared prefixes of one model's cache, what a shared fetch takes of them,
and the counters of shared fetches.

``PrefixCache.fetch(tokens, shared=True)`` asks the registry for a live
prefix; when none covers what the tiers would restore, it restores privately
and hands the restore to ``adopt``, which turns it into a new shared prefix
(or the suffix of a live one). Prefixes are held weakly: a prefix lives while
its sequences do, and the registry only finds it for the next sequence. The
attention hook is installed while any shared prefix lives (one install per
prefix, undone when the prefix is freed). Falls back to private caches,
counted by reason, when the model's attention cannot be hooked (probed once,
by running the model), has no layer to share, or its K/V are due to be
quantized by mlx-lm later (``kv_bits`` with ``quantized_kv_start`` beyond the
cached tokens: a shared cache is not re-quantized in place).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..hashing import TOKEN_BYTES, common_tokens
from . import hook
from .build import blank, sequence, share
from .prefix import SharedPrefix
from .probe import SharedLayout, probe

KV_QUANT = "kv_quant_pending"


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

    Args:
        model: the model whose attention layers share prefixes.
        signature: the cache layout signature (``ModelLayout.signature``).
        kv_bits, quantized_kv_start: mlx-lm's K/V quantization schedule.

    Attributes:
        lock: held around a whole shared fetch (which restores privately inside it).
        used: whether any shared fetch or blank cache was asked for (stats show it).
    """

    def __init__(
        self,
        model: nn.Module,
        signature: tuple[tuple[object, ...], ...],
        kv_bits: int | None,
        quantized_kv_start: int,
    ) -> None:
        self.lock = threading.RLock()
        self.used = False
        self._model = model
        self._signature = signature
        self._kv_bits = kv_bits
        self._quantized_kv_start = quantized_kv_start
        self._layout: SharedLayout | None = None
        # the live prefixes and counters; never held while calling out, so stats()
        # (called under the PrefixCache's lock) cannot wait on a fetch in progress
        self._state = threading.Lock()
        self._counters = SharedCounters()
        self._live: dict[bytes, weakref.WeakSet[SharedPrefix]] = {}

    def unavailable(self) -> str | None:
        """Why this model's caches cannot be shared (probed once), or None."""
        self.used = True
        return self._shared_layout().reason

    def quant_ok(self, num_tokens: int) -> bool:
        """Whether a shared cache holding ``num_tokens`` matches mlx-lm's K/V packing
        from now on (mlx-lm quantizes a KVCache in place once it reaches the start)."""
        return self._kv_bits is None or 0 < num_tokens >= self._quantized_kv_start

    def live(self, root: bytes, data: bytes) -> tuple[SharedPrefix | None, int]:
        """``best`` of the live prefixes, none where its K/V packing would not match."""
        prefix, usable = self.best(root, data)
        return (prefix, usable) if self.quant_ok(usable) else (None, 0)

    def reuse(self, prefix: SharedPrefix, usable: int) -> list[Any]:
        """A sequence's caches on ``usable`` tokens of a live prefix (nothing copied)."""
        self.count(reused=usable)
        return sequence(prefix, usable)

    def adopt(
        self,
        root: bytes,
        data: bytes,
        restored: list[Any],
        num_cached: int,
        live: SharedPrefix | None,
        usable: int,
    ) -> tuple[list[Any], int]:
        """A sequence's caches after a private restore of ``num_cached`` tokens of
        ``data``: the live prefix where it covers as much, the live prefix plus the
        restore's extra tokens where it can be cut back, else a new shared prefix."""
        if live is not None and usable >= num_cached:  # the restore fell short of the index
            return self.reuse(live, usable), usable
        if not self.quant_ok(num_cached):
            self.fell_back(KV_QUANT)
            return restored, num_cached
        if num_cached == 0:
            self.count()
            return blank(self._shared_layout().at(None), restored), 0
        if live is not None and live.trimmable:
            self.count(gap=True, reused=usable)
            return sequence(live, usable, gap=(restored, num_cached)), num_cached
        prefix = share(root, data, restored, num_cached, self._signature)
        self.add(prefix)
        self.count()
        return sequence(prefix, num_cached), num_cached

    def blank_caches(self) -> list[Any]:
        """Empty caches for a sequence with no cached prefix, of the types a shared
        fetch gives (they batch together with shared ones)."""
        with self.lock:
            fresh = make_prompt_cache(self._model)
            if self.unavailable() is not None or not self.quant_ok(0):
                return fresh
            return blank(self._shared_layout().at(None), fresh)

    def _shared_layout(self) -> SharedLayout:
        if self._layout is None:
            self._layout = probe(self._model, self._signature)
        return self._layout

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
