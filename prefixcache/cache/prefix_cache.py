"""PrefixCache: the facade a scheduler calls around its prefill. Policy lives here."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.nn as nn

from ..background.prefetch import Job, Prefetcher, job_of
from ..background.services import Services
from ..config import CacheConfig
from ..hashing import TOKEN_BYTES, Namespace, chain_keys, token_bytes
from ..memory import give_back
from ..shared import fetch_shared, shared_stats
from ..stats import Stats, ram_stats
from ..stats_types import CacheStats
from ..tiers import lower_tiers, quiet
from ..tiers.base import Tier
from ..tiers.controls import Controls, check_session, tail_keys
from ..tiers.hot.recent import Kept, kept_views, whole_bytes
from ..tiers.stack import TierStack
from .capture import cut_blocks
from .checkpoint_verbs import CheckpointVerbs, nonempty
from .control_verbs import ControlVerbs
from .layout import ModelLayout
from .lookup import Lookup
from .model_id import model_fingerprint
from .restore import restore


class PrefixCache(CheckpointVerbs, ControlVerbs):
    """A tiered, block-aware prefix cache for one model.

    Args:
        model: the mlx-lm model whose caches are stored.
        config: settings; defaults to ``CacheConfig.from_env()``.
        model_id: identity of the weights (e.g. "org/name@revision"); when
            omitted, a fingerprint of the weights is used.
        tiers: the tiers below hot, in lookup order, instead of those the
            config builds (e.g. a tier of another package); they are closed
            with the cache.
    """

    def __init__(
        self,
        model: nn.Module,
        config: CacheConfig | None = None,
        *,
        model_id: str | None = None,
        tiers: Sequence[Tier] | None = None,
    ):
        self.model = model
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.RLock()
        self._stats = Stats()
        self.layout = ModelLayout(model, self.config)
        self.namespace = Namespace(
            model_id or model_fingerprint(model), self.layout.signature, self.layout.kv_quant
        )
        self._roots: dict[tuple[tuple[str, str], ...], bytes] = {}
        self._last_shared: tuple[bytes, bytes, int] | None = None  # (prompt, root, shared)
        self._last_keys: tuple[bytes, bytes, list[bytes]] | None = None  # (prompt, root, restored)
        lower = lower_tiers(self.config) if tiers is None else list(tiers)
        shed = self.layout.without_state if self.layout.state_prefixes else None
        cost = self.layout.block_cost if self.config.eviction == "cost" else None
        self.tiers = TierStack(self.config, self._stats, lower, shed, cost)
        self.lookup = Lookup(self.config, self.layout, self.tiers)
        self.controls = Controls(self.tiers)
        self._closed = False
        self._final_stats: CacheStats | None = None
        bound = min(self.config.prefetch_bytes, self.config.hot_max_bytes // 2)
        self.prefetcher = Prefetcher(self.tiers, self._lock, self._stats, bound)
        self.services = Services(
            self.config, self.tiers, self._lock, self._stats, lambda: self._root(None)
        )

    # -- public API -------------------------------------------------------

    def fetch(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None, shared: bool = False
    ) -> tuple[list[Any], int]:
        """A fresh cache holding the deepest restorable prefix of ``tokens``.

        Every stored block, tail and checkpoint that shares a prefix with the
        prompt is a candidate; the deepest one every layer can be rebuilt at
        wins (lookup.py). Always leaves at least one token to prefill.
        ``shared=True``: one K/V copy for every sequence on the prefix
        (prefixcache/shared).

        Returns:
            (cache list for the model, number of tokens it holds)
        """
        quiet.open_window(self.config.background_quiet_ms / 1000)  # its prefill follows
        if shared:
            return fetch_shared(self, tokens, extra=extra)
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            root = self._root(extra)
            self.prefetcher.fetching(data, root)  # what is still queued for it: not loaded
            got = restore(self.lookup, data, root, headroom=self.config.restore_headroom)
            self._last_shared = (data, root, got.shared)
            self._last_keys = (data, root, got.keys)
            self.controls.used(got.keys)
            self.prefetcher.used(got.keys)
            if got.promote:  # loaded again into the tiers above, off this request's path
                self.prefetcher.submit(Job(data, root, got.keys, got.promote, promote=True))
            self._stats.fetched(len(data) // TOKEN_BYTES, got.num_tokens, got.reason)
            return got.cache, got.num_tokens

    def prefetch(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Start promoting the blocks of ``tokens``' restore that only a lower tier
        holds into hot, on a background thread; returns at once (how many blocks
        it queued). For a request that waits: its ``fetch`` takes what arrived
        and waits for nothing else (prefetch.py)."""
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            root = self._root(extra)
            plan = self.lookup.plan(data, root)
            hot = self.hot
            job = job_of(data, root, plan.entries, plan.tiers, lambda key: key not in hot)
            return self.prefetcher.submit(job)

    def match(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """Tokens ``fetch`` would restore (from the tiers' metadata; restores nothing)."""
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            return self.lookup.plan(data, self._root(extra)).num_tokens

    def store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
        hand_over: bool = False,
    ) -> int:
        """Keep what ``cache`` (holding exactly ``tokens``) adds: every new full block
        and the tail (the tokens after the last full block), with every layer's
        state at the exact end. Returns how many new full blocks were kept.

        After generating, the cache holds the prompt and every generated token
        but the last: ``store(tokens + generated[:-1], cache)``. The next turn
        of a conversation then resumes from there on every layout.
        ``session`` tags the blocks only this session holds (``end_session``
        drops them); ``persist=False`` keeps them hot only, never written to a
        lower tier (docs/operating.md). ``hand_over=True``: the caller is done
        with ``cache`` (mlx-lm's server at insert); with ``restore_headroom=0``
        the hot tier may keep views of its arrays while it has room, and a
        fetch they hold gets them without a copy (tiers/recent.py).

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        return self._store(
            tokens, cache, extra, session=session, persist=persist, hand_over=hand_over
        )

    def stats(self) -> CacheStats:
        """Counters and each tier's figures (docs/stats.md); after ``close``, as
        they were at close."""
        with self._lock:
            if self._closed:
                if self._final_stats is None:
                    raise RuntimeError("PrefixCache is closed")
                return self._final_stats
            return self._collect_stats()

    def _collect_stats(self) -> CacheStats:
        tiers = self.tiers.snapshot()
        written = tiers["ssd"].get("written_bytes", 0) if "ssd" in tiers else 0
        out = self._stats.as_dict() | self.controls.stats() | {"ssd_bytes_written": written}
        out["ram"] = ram_stats(tiers, self.prefetcher.loading_bytes)
        return cast(CacheStats, out | tiers | self.services.stats() | shared_stats(self))

    def flush(self) -> None:
        """Finish the promotions and prefetches under way, persist every dirty hot
        block to the lower tiers and wait for their writes."""
        self.prefetcher.join()  # not under the lock: its thread takes it
        with self._lock:
            self.tiers.flush()
            self.services.save_counters()

    def close(self) -> None:
        self.prefetcher.close()  # not under the lock: its thread may be waiting for it
        self.services.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.tiers.flush()
                self.services.save_counters()
                self._final_stats = self._collect_stats()
            finally:
                try:
                    self.tiers.close()
                finally:
                    self.services.close()
                    self.tiers.drop_hot()
                    give_back.now()  # what the tiers held leaves the process

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _shared(self, data: bytes, root: bytes) -> int:
        """``stored_prefix`` (the last fetch's when it was of the same prompt)."""
        last = self._last_shared
        if last is not None and last[0] == data and last[1] == root:
            return last[2]
        return self.lookup.shared(data, root)

    def _store(
        self,
        tokens: Sequence[int],
        cache: Sequence[Any],
        extra: Mapping[str, str] | None,
        *,
        session: str | None,
        persist: bool,
        hand_over: bool = False,
    ) -> int:
        data = token_bytes(tokens)
        check_session(session)
        with self._lock:
            self._check_open()
            self.layout.validate(cache, len(data) // TOKEN_BYTES)
            root = self._root(extra)
            bs = self.config.block_size
            keys = chain_keys(root, data, bs)
            cut = cut_blocks(
                keys,
                root,
                data,
                cache,
                block_size=bs,
                snapshot_interval=self.layout.snapshot_interval,
                stored=self.tiers.contains,
                resident=self.hot.get,
                window=self.layout.window_policy,
            )
            self._last_shared = None  # what is stored changed
            tail = cut.tail
            continues = self.tiers.continues([*cut.new, *([tail] if tail else [])])
            self.tiers.place(cut.new, persist=persist, continues=continues)
            self.tiers.replace(cut.upgraded)
            if tail is not None:
                self.tiers.place_tail(tail, persist=persist, continues=continues)
            stored = [*cut.new, *([tail] if tail else [])]
            self.hot.prepare_views([*stored, *cut.upgraded])
            walked = [*keys, *tail_keys(root, keys, data, bs)]
            self.controls.stored(session, persist, stored, walked)
            if hand_over and not self.config.restore_headroom:
                self._keep_whole(root, data, walked, cache)
            if not self.layout.keeps_state:  # else a tail's end state is its own
                for block in [*cut.new[-1:], *([tail] if tail else [])]:
                    self.hot.drop_superseded(block)
            self._stats.num_stores += 1
            return len(cut.new)

    def _keep_whole(self, root: bytes, data: bytes, keys: list[bytes], cache: Sequence[Any]):
        """Keep ``cache``'s arrays whole in hot (tiers/recent.py), where its layers allow
        and the blocks leave room."""
        nbytes = whole_bytes(cache)
        if nbytes is not None and nbytes <= self.hot.room:
            views = kept_views(cache, len(data) // TOKEN_BYTES)
            self.hot.keep_recent(Kept(root, data, frozenset(keys), views, nbytes))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixCache is closed")

    def _root(self, extra: Mapping[str, str] | None) -> bytes:
        items = tuple(sorted(extra.items())) if extra else ()
        root = self._roots.get(items)
        if root is None:
            namespace = self.namespace.with_extra(extra)
            root = self._roots[items] = namespace.root_key()
            # once per root per process: `prefixcache stats` per model
            self.tiers.note_namespace(root, namespace.to_json())
        return root
