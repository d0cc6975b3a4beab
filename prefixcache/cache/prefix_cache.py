"""PrefixCache: the facade a scheduler calls around its prefill, every public verb in one class.

The scheduler's verbs (``fetch``, ``prefetch``, ``match``, ``store``), the
checkpoint protocol (``stored_prefix``, ``checkpoints``, ``capture``,
``prefill``: state that cannot be cut back is kept where prompts resume), the
operator controls (``pin``, ``unpin``, ``end_session``, ``trim_hot``; what each
does is in docs/operating.md) and the cache's life (``stats``, ``flush``,
``close``). Each verb holds the cache's lock and hands the work down: to the
lookup and restore of this wing, the tier stack and its controls, the shared
prefixes' registry and the background services.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..background.prefetch import Job, Prefetcher, job_of
from ..background.services import Services
from ..config import CacheConfig
from ..errors import MissReason
from ..hashing import TOKEN_BYTES, Namespace, chain_keys, nonempty, token_bytes
from ..memory import give_back
from ..shared import SharedRegistry
from ..shared.fetch import fetch_shared
from ..stats import Stats, ram_stats
from ..stats_types import CacheStats
from ..tiers import lower_tiers, quiet
from ..tiers.base import Tier
from ..tiers.controls import Controls, check_session, tail_keys
from ..tiers.hot.tier import HotTier
from ..tiers.pins import pin_until
from ..tiers.stack import TierStack
from .capture import cut_blocks
from .explain import Explainer
from .explanation import Explanation
from .layout import ModelLayout
from .lookup import Lookup
from .model_id import model_fingerprint
from .restore import restore
from .tenancy import Tenancy, check_tenant


class PrefixCache:
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
        # the last fetch: (prompt, root, shared, restored, why not more)
        self._last_shared: tuple[bytes, bytes, int, int, MissReason | None] | None = None
        self._last_keys: tuple[bytes, bytes, list[bytes]] | None = None  # (prompt, root, restored)
        lower = lower_tiers(self.config) if tiers is None else list(tiers)
        shed = self.layout.without_state if self.layout.state_prefixes else None
        cost = self.layout.block_cost if self.config.eviction in ("cost", "adaptive") else None
        self.tiers = TierStack(self.config, self._stats, lower, shed, cost)
        self.lookup = Lookup(self.config, self.layout, self.tiers)
        self.controls = Controls(self.tiers)
        self.tenancy = Tenancy(self.tiers)  # who a store charges (tenancy.py)
        self.explainer = Explainer(self.lookup, self.namespace, self._roots)
        self._closed = False
        self._final_stats: CacheStats | None = None
        bound = min(self.config.prefetch_bytes, self.config.hot_max_bytes // 2)
        self.prefetcher = Prefetcher(self.tiers, self._lock, self._stats, bound)
        self.services = Services(
            self.config,
            self.tiers,
            self._lock,
            self._stats,
            lambda: self._root(None),
            self.layout.groups,
        )
        cfg = self.config
        self.shared_prefixes = SharedRegistry(
            model, self.layout.signature, cfg.kv_bits, cfg.quantized_kv_start
        )

    # -- the scheduler's verbs ---------------------------------------------

    def fetch(
        self,
        tokens: Sequence[int],
        *,
        extra: Mapping[str, str] | None = None,
        shared: bool = False,
        headroom: int | None = None,
    ) -> tuple[list[Any], int]:
        """A fresh cache holding the deepest restorable prefix of ``tokens``.

        Every stored block, tail and checkpoint that shares a prefix with the
        prompt is a candidate; the deepest one every layer can be rebuilt at
        wins (lookup.py). Always leaves at least one token to prefill.
        ``shared=True``: one K/V copy for every sequence on the prefix
        (``prefixcache.shared``, docs/shared-prefix.md). ``headroom``: this
        fetch's ``restore_headroom`` (default: the config's).

        Returns:
            (cache list for the model, number of tokens it holds)
        """
        quiet.open_window(self.config.background_quiet_ms / 1000)  # its prefill follows
        data = nonempty(tokens)
        if shared:
            return fetch_shared(
                self.shared_prefixes,
                data,
                lambda: self._open_root(extra),
                lambda: self.fetch(tokens, extra=extra),
                lambda: self.match(tokens, extra=extra),
            )
        with self._lock:
            self._check_open()
            root = self._root(extra)
            self.prefetcher.fetching(data, root)  # what is still queued for it: not loaded
            room = self.config.restore_headroom if headroom is None else headroom
            got = restore(self.lookup, data, root, headroom=room)
            self._last_shared = (data, root, got.shared, got.num_tokens, got.reason)
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
        tenant: str | None = None,
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
        fetch they hold gets them without a copy (tiers/recent.py). ``tenant``: who
        the new blocks are charged to under tenant shares (cache/tenancy.py).

        Raises:
            UnsupportedCacheError: a layer's cache type has no codec.
            LayoutMismatchError: the cache does not fit this model's layout.
            ValueError: the cache does not hold exactly ``len(tokens)`` tokens.
        """
        keep = {"session": session, "persist": persist, "tenant": tenant}
        return self._store(tokens, cache, extra, hand_over=hand_over, **keep)

    # -- the checkpoint protocol --------------------------------------------

    def stored_prefix(
        self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None
    ) -> int:
        """Tokens of ``tokens`` some stored sequence shares, restorable or not.

        Where this exceeds ``match`` on a model whose state cannot be cut back
        (recurrent layers, windows), the prompt leaves a stored sequence there
        without state to resume from: ``checkpoints`` names it.
        """
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            return self._shared(data, self._root(extra))

    def checkpoints(
        self,
        tokens: Sequence[int],
        num_cached: int = 0,
        *,
        extra: Mapping[str, str] | None = None,
    ) -> list[int]:
        """Where to ``capture`` the cache while prefilling ``tokens``: ascending
        positions in ``(num_cached, len(tokens))``.

        A model whose caches can be cut back to any token (KV, quantized,
        windows that have not wrapped) needs none: the list is empty. Else,
        Marconi-style: the junction where the prompt leaves a stored sequence
        it shares a prefix with (``stored_prefix``, at the exact token: the
        shared prefix's second sighting), the prompt's end minus
        ``checkpoint_tail`` tokens (an exact repeat, or a next turn whose
        template re-renders the last tokens, resumes there), and the snapshot
        interval's points (``layout.snapshot_interval`` blocks apart: prompts
        that will branch where nothing is stored yet). The scheduler loop::

            cache, n = pc.fetch(tokens)
            for stop in pc.checkpoints(tokens, n):
                ...prefill tokens[n:stop] into cache...; n = stop
                pc.capture(tokens[:stop], cache)
            ...prefill the rest, generate...
            pc.store(tokens + reply[:-1], cache)
        """
        data = nonempty(tokens)
        if not self.lookup.needs_checkpoints(len(data) // TOKEN_BYTES):
            return []
        with self._lock:
            self._check_open()
            shared = self._shared(data, self._root(extra))
        return self.lookup.checkpoints(len(data) // TOKEN_BYTES, num_cached, shared)

    def capture(
        self,
        tokens_so_far: Sequence[int],
        cache: Sequence[Any],
        *,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
        tenant: str | None = None,
    ) -> int:
        """``store`` for a cache in the middle of a prefill, at a checkpoint: keeps the
        state at exactly ``len(tokens_so_far)`` (a tail carrying it, or the block
        ending there), with the window and chunk K/V a restore there needs.

        Raises:
            the errors of ``store``: a cache that does not hold exactly
            ``tokens_so_far`` cannot be kept there.
        """
        keep = {"session": session, "persist": persist, "tenant": tenant}
        return self._store(tokens_so_far, cache, extra, **keep)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefill_step_size: int | None = None,
        extra: Mapping[str, str] | None = None,
        session: str | None = None,
        persist: bool = True,
        tenant: str | None = None,
    ) -> tuple[list[Any], mx.array]:
        """``fetch``, prefill the rest capturing at every checkpoint, ``store``.

        ``prefill_step_size`` (a multiple of ``block_size``; chunks also end on
        its multiples) defaults to about mlx-lm's 2048 tokens. Returns (cache,
        last logits).
        """
        from .prefill import prefill  # the loop on the public verbs above

        keep = {"extra": extra, "session": session, "persist": persist, "tenant": tenant}
        return prefill(self, tokens, prefill_step_size=prefill_step_size, **keep)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """Report a prefill of ``num_tokens`` that took ``seconds`` (``prefill`` does;
        a scheduler with its own loop may): the remote tier's cost gate weighs
        fetching a prefix against recomputing it at this speed."""
        with self._lock:
            self.tiers.note_prefill(num_tokens, seconds)

    def explain(
        self,
        tokens: Sequence[int],
        *,
        extra: Mapping[str, str] | None = None,
        tokenizer: Any = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Any] | None = None,
    ) -> Explanation:
        """Where ``tokens`` leave the nearest stored sequence and why no more is
        restored; ``tokenizer`` decodes the excerpts, and with ``messages`` (and
        ``tools``) places the divergence in a message (cache/explain.py)."""
        data = nonempty(tokens)
        with self._lock:
            self._check_open()
            record = self.explainer.explain(data, self._root(extra), self._last_shared, tokenizer)
        return self.explainer.placed(record, tokens, messages, tokenizer, tools)  # unlocked

    # -- operator controls --------------------------------------------------

    def pin(
        self,
        tokens: Sequence[int],
        ttl: float | None = None,
        *,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """Keep the stored blocks of ``tokens`` in every tier until the pin ends.

        Pinned blocks are never evicted from hot nor from the SSD tier (a block
        held only below hot is loaded into hot; one not yet on the SSD tier is
        written now); their bytes count against each tier's cap. ``ttl``
        (seconds) ends the pin, not the blocks; pins are kept in the SSD
        index, so they survive a restart. Pinning again sets a new end.

        Returns:
            tokens pinned: those of the stored chain of ``tokens`` (and of its
            stored tail); 0 if nothing of it is stored.

        Raises:
            ValueError: ``tokens`` is empty, or ``ttl`` is not > 0.
            PinCapacityError: a tier's pinned bytes would pass its cap (nothing changes).
        """
        data = token_bytes(tokens)
        if not data:
            raise ValueError("cannot pin an empty prompt: tokens is empty")
        until = pin_until(ttl, time.time())
        with self._lock:
            self._check_open()
            pinned = self.controls.pin(self._keys(data, extra), until)
            return sum(b.num_tokens for b in pinned)

    def unpin(self, tokens: Sequence[int], *, extra: Mapping[str, str] | None = None) -> int:
        """End the pins of the blocks of ``tokens`` (they stay, evictable again);
        returns how many blocks were pinned."""
        data = token_bytes(tokens)
        if not data:
            raise ValueError("cannot unpin an empty prompt: tokens is empty")
        with self._lock:
            self._check_open()
            return self.controls.unpin(self._keys(data, extra))

    def begin_session(self, session: str, *, tenant: str) -> None:
        """Name ``tenant`` the owner of ``session``, charged for its stores (tenancy.py)."""
        check_session(session)
        check_tenant(tenant)
        with self._lock:
            self._check_open()
            self.controls.begin(session)
            self.tenancy.begin(session, tenant)

    def end_session(self, session: str) -> int:
        """Drop at once, from every tier, the blocks only ``session`` holds (prefixes
        another store shares stay, and so do pinned blocks); returns how many.

        Raises:
            ValueError: unknown ``session`` (no store used it, or it ended).
        """
        with self._lock:
            self._check_open()
            held = self.tiers.hot.nbytes
            num = self.controls.end(session)
            self.tenancy.end(session)
            give_back.note_freed(held - self.tiers.hot.nbytes)  # removed, not evicted
        give_back.maybe()
        return num

    @property
    def hot(self) -> HotTier:
        return self.tiers.hot

    @property
    def ssd(self) -> Any:
        """The SSD tier, or None (``hot_cache_only``)."""
        return self.tiers.named("ssd")

    def trim_hot(
        self,
        max_bytes: int,
        *,
        first: Sequence[int] | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> int:
        """Evict hot blocks (leaves first, pinned ones kept) until at most
        ``max_bytes`` are held; dirty blocks spill as on any eviction. Returns how
        many blocks left the hot tier.

        ``first``: the tokens of a request in flight whose cache will be stored
        when it ends. Its restored chain is held twice meanwhile (in hot and in
        the request's cache), so its blocks go first, deepest first, where the
        store puts each of them back into hot from the cache: every layer can be
        cut back, and no lower tier holds them (with one, they spill there, the
        store skips them as stored, and the request's next turn reads them back:
        the policy's own choice keeps them hot instead); then the policy's choice.
        """
        limit = max(0, max_bytes)
        with self._lock:
            self._check_open()
            num = 0
            hot = self.tiers.hot
            if hot.nbytes <= limit:
                return 0
            if first and not self.layout.checkpointed and not self.tiers.lower:
                data, root = token_bytes(first), self._root(extra)
                last = self._last_keys  # the blocks its fetch restored, else the plan again
                same = last is not None and last[0] == data and last[1] == root
                keys = last[2] if same else self.lookup.plan(data, root).keys
                num = hot.evict_chain(reversed(keys), limit)
            num += hot.evict_to(limit)
        give_back.maybe()  # the evicted arrays are unreferenced now (memory/give_back.py)
        return num

    # -- the cache's life -----------------------------------------------------

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
        if tenants := self.tenancy.stats():
            out["tenants"] = tenants
        return cast(CacheStats, out | tiers | self.services.stats() | self._shared_stats())

    def tenant_stats(self, tenant: str) -> dict[str, dict[str, int]]:
        """``stats()["tenants"][tenant]``; ValueError naming an unknown ``tenant``."""
        with self._lock:
            return self.tenancy.stats_of(tenant)

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
        tenant: str | None,
        hand_over: bool = False,
    ) -> int:
        data = token_bytes(tokens)
        check_session(session)
        check_tenant(tenant)
        with self._lock:
            self._check_open()
            self.layout.validate(cache, len(data) // TOKEN_BYTES)
            root = self._root(extra)
            keys = chain_keys(root, data, self.config.block_size)
            cut = cut_blocks(
                keys,
                root,
                data,
                cache,
                block_size=self.config.block_size,
                points=self.layout.restore_points,
                stored=self.tiers.contains,
                resident=self.hot.get,
                window=self.layout.window_policy,
                tenant=self.tenancy.owner(tenant, session, extra),
                runs=(self.config.hot_run_tokens, self.config.hot_max_bytes // 16),
            )
            self._last_shared = None  # what is stored changed
            stored = [*cut.new, *([cut.tail] if cut.tail else [])]
            continues = self.tiers.continues(stored)
            with self.tenancy.charging(tenant, session, extra):
                self.tiers.place(cut.new, persist=persist, continues=continues)
                self.tiers.replace(cut.upgraded)
                if cut.tail is not None:
                    self.tiers.place_tail(cut.tail, persist=persist, continues=continues)
            self.hot.prepare_views([*stored, *cut.upgraded])
            walked = [*keys, *tail_keys(root, keys, data, self.config.block_size)]
            self.controls.stored(session, persist, stored, walked)
            if hand_over and not self.config.restore_headroom:  # kept whole (hot/recent.py)
                self.hot.keep_whole(root, data, walked, cache)
            if not self.layout.keeps_state:  # else a tail's end state is its own
                for block in [*cut.new[-1:], *([cut.tail] if cut.tail else [])]:
                    self.hot.drop_superseded(block)
            self._stats.num_stores += 1
            return len(cut.new)

    def _keys(self, data: bytes, extra: Mapping[str, str] | None) -> list[bytes]:
        """Chain keys of ``data``'s full blocks, then its tail's key if it has one."""
        root = self._root(extra)
        keys = chain_keys(root, data, self.config.block_size)
        return [*keys, *tail_keys(root, keys, data, self.config.block_size)]

    def _shared_stats(self) -> dict[str, object]:
        """``{"shared": counters and live prefixes}`` once a shared fetch was asked for."""
        registry = self.shared_prefixes
        return {"shared": registry.stats()} if registry.used else {}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixCache is closed")

    def _open_root(self, extra: Mapping[str, str] | None) -> bytes:
        with self._lock:
            self._check_open()
            return self._root(extra)

    def _root(self, extra: Mapping[str, str] | None) -> bytes:
        items = tuple(sorted(extra.items())) if extra else ()
        root = self._roots.get(items)
        if root is None:
            namespace = self.namespace.with_extra(extra)
            root = self._roots[items] = namespace.root_key()
            # once per root per process: `prefixcache stats` per model
            self.tiers.note_namespace(root, namespace.to_json(), self.layout.run_hints)
            self.services.note_namespace(root, items)
        return root
