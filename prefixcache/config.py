"""CacheConfig: every setting of a PrefixCache, loadable from PREFIXCACHE_* env vars.

Each field's default, meaning and rule: a value is checked when a config is
made, so a config that exists is usable.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from . import settings
from .connections import check_events, check_remote, check_remote_trust, redact_url
from .settings import ENV_PREFIX, parse_bytes
from .shares_config import check_tenant_shares

__all__ = [
    "DEFAULT_EVICTION",
    "ENV_PREFIX",
    "EVENTS_FORMATS",
    "EVICTIONS",
    "QUEUE_FULL_POLICIES",
    "WRITE_POLICIES",
    "CacheConfig",
    "parse_bytes",
    "redact_url",
]

WritePolicy = Literal["write_back", "write_through"]
WRITE_POLICIES = ("write_back", "write_through")
Eviction = Literal["cost", "lru", "fifo", "density", "frequency", "adaptive"]
EVICTIONS = ("adaptive", "cost", "lru", "fifo", "density", "frequency")
DEFAULT_EVICTION: Eviction = "adaptive"  # serve's, replay's and simulate's default too
QueueFullPolicy = Literal["drop", "inline"]
EventsFormat = Literal["vllm", "sglang"]
EVENTS_FORMATS = ("vllm", "sglang")
QUEUE_FULL_POLICIES = ("drop", "inline")
MIN_WRITE_QUEUE_BYTES = 4 << 20  # the default queue bound's floor


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Settings of a PrefixCache. The same names are CLI flags and env vars.

    Every value must fit its field's type (numbers finite; a bool is not an
    int) and its field's rule below; misuse raises
    :class:`~prefixcache.errors.ConfigError` (a ``ValueError``) naming the
    field and the value. ``from_env`` reads ``PREFIXCACHE_<FIELD>`` variables
    (sizes as ``8G``, ``512M``; booleans as 1/0, true/false, yes/no, on/off).

    Attributes:
        block_size: tokens per block: full blocks form the hashed chain; the
            tokens after the last full block are kept too, as a tail.
        hot_max_bytes: byte budget of the hot tier (live arrays in RAM).
        hot_cache_only: keep everything in RAM; no SSD directory, no disk I/O.
        hot_run_tokens: the plain KVCache layers of the new consecutive blocks
            of one store are kept as runs of up to this many tokens (one array
            per layer's K and V, at most a sixteenth of ``hot_max_bytes``; each
            block a view of it; a window or recurrent layer's payload stays the
            block's own), and a hot restore copies a run's blocks in one copy per
            array (memory/runs.py). The default,
            256, makes runs only of blocks smaller than that (a 64-dim bf16 head
            gives 32 KiB per 256 tokens: copies of that size run at memcpy speed);
            0: each block owns its arrays.
        eviction: which hot block goes first when RAM is full (always a leaf,
            never a pinned block): ``cost`` weighs recency against what the
            block saves per byte (its recompute FLOPs: deep blocks cost more,
            costs.py), among the least recently used leaves; ``lru``: the
            least recently used leaf; ``density``: the sampled leaf of least
            expected hits per block held, learnt from the traffic, and a
            newcomer worth less than that is not kept (tiers/hot/density.py);
            ``frequency``: the leaf of least use count over an aging floor, and
            a newcomer used no more than that is not kept (frequency.py);
            ``adaptive`` (the default): ``frequency``'s victim, its aging and a
            sampled admission of new chains set by the reach it measures
            (``cost``'s victim until then, LRU's from a reach of 0.9:
            tiers/hot/adaptive.py); ``fifo``: the leaf stored first. Which to
            pick: docs/eviction.md.
        prefetch_bytes: ``prefetch`` holds at most this many bytes of blocks it
            promoted into hot and no fetch has used yet (at most half of
            ``hot_max_bytes``); 0: ``prefetch`` does nothing.
        ssd_dir: directory of the SSD tier (LMDB index + payload files).
        ssd_max_bytes: byte budget of the SSD tier's payloads.
        ssd_min_free_bytes: free disk space the SSD tier always leaves.
        ssd_run_tokens: consecutive blocks of one chain written in one batch
            share one payload file of up to this many tokens (the K/V they all
            have one after another on the token axis, a block's other tensors,
            such as state snapshots, whole), so a restore reads big pieces
            (tiers/ssd/runfiles.py); 0: one file per block.
        ssd_run_growth: a run file may also hold up to this share of the
            chain's tokens before it, where that is more than ``ssd_run_tokens``:
            a long chain then lies in few files (fewer opens and headers per
            restore), while a hit ending inside a run reads at most this share
            of its own tokens more; 0: every run ``ssd_run_tokens``.
        write_policy: ``write_back`` spills on hot eviction; ``write_through``
            writes every stored block at once.
        write_queue_bytes: bound of each background writer's queue (ssd,
            remote): blocks queued for a lower tier are RAM beside the hot
            tier's, so None (the default) makes it ``hot_max_bytes // 8``, at
            least 4 MiB (512 MiB beside the default 4 GiB; the floor keeps a
            small budget's write-through stores from being dropped); see
            ``write_queue_limit``.
        queue_full: ``drop`` (count and skip) or ``inline`` (write on the
            caller's thread) when the queue is full.
        promote: copy SSD hits into the hot tier when it has room.
        background_quiet_ms: after each fetch, the background writers and
            promotions start nothing new for this long (the request's prefill
            runs then), unless a flush waits or a queue is over half full;
            back to back, each batch or promotion waits at most this long and
            then runs, so the background work keeps a share; 0: they never
            wait (quiet.py).
        kv_bits: KV quantization bits (as mlx-lm's ``kv_bits``), or None.
        kv_group_size: KV quantization group size.
        quantized_kv_start: cache length from which mlx-lm quantizes.
        restore_headroom: extra tokens of buffer a restored cache gets beyond
            the prompt, so the prefill of its rest writes in place and decoding
            does not re-allocate at once (left unwritten: mlx-lm reads a cache
            only below its offset; ``prefixcache serve`` gives 1, room for the
            first token); 0: the buffer holds the restored tokens only (with
            ``store(..., hand_over=True)``, fetches may get views of a kept
            sequence: tiers/recent.py).
        snapshot_interval: during prefill, a restore point every N blocks: a
            recurrent-state snapshot, and sliding-window K/V in the blocks its
            window covers; 0 (the default) picks N from ``snapshot_ratio`` and adds
            points after 1, 2, 4 ... blocks below N (cache/points.py). The end
            of every stored sequence is a restore point whatever N is.
        snapshot_ratio: with ``snapshot_interval=0``, what interval points keep
            (snapshot and window K/V bytes) is at most this multiple of the
            full-attention K/V bytes of the blocks they sit on (N = ceil(point
            bytes / (ratio * K/V bytes of a block))); a model without
            full-attention layers has a restore point at every block.
        checkpoint_tail: ``PrefixCache.checkpoints`` keeps the state this many
            tokens before a prompt's end, so an exact repeat, or a next turn
            whose chat template re-renders the last tokens, resumes there
            (mlx-lm's server keeps a segment of up to 11 tokens at the end).
        ssd_retry_seconds: after a disk or index failure turned the SSD tier's
            writes off, how long until the writer probes the directory again.
        counters_save_seconds: how often a cache adds its counters to the
            lower tiers' records (besides ``flush``/``close``), so a killed
            process loses at most that much of them; 0: only on flush/close.
        remote_url: the shared remote tier's server (``redis://``, ``rediss://``
            or ``unix://``, Redis or Valkey), or a cluster
            (``redis+cluster://host:port,host:port``, ``rediss+cluster://`` with
            TLS: any of its nodes), or None for no remote tier.
        remote_prefix: namespace of every key the remote tier writes.
        remote_connect_timeout_ms: give up connecting after this long.
        remote_timeout_ms: give up on one remote call after this long.
        remote_breaker_failures: consecutive failures that open the breaker.
        remote_breaker_ms: how long an open breaker skips every remote call.
        remote_max_bytes: stop writing while the server uses more memory than
            this (0: leave it to the server's ``maxmemory``); with remote tenant
            shares, the bytes of values the tenants share, kept by evicting.
        prefill_tokens_per_s: recompute speed the remote cost gate compares a
            remote restore with (0: measured by ``PrefixCache.prefill``).
        ssd_admit_after: a block is written to the SSD tier only once it has
            been used this many times (stored, then restored); 1 writes every
            block, 2 admits on the second sighting (docs/operating.md); 0:
            decided by the SSD's measured reach (tiers/governor.py: every block
            while the SSD holds most blocks until their reuse, else those seen
            before and a 10% sample of new ones).
        ssd_write_budget: bytes the SSD tier may write per day (a leaky bucket
            shared by every process of the directory); 0: no budget.
        warm_bytes: on open, load pinned blocks and the most recently used
            chains, up to this many bytes, from the SSD tier into hot, in the
            background; 0: no warm start.
        events_url: publish BlockStored / BlockRemoved events (vLLM's KV-events
            layout) on a ZeroMQ PUB socket at this address (``tcp://*:5557``
            binds); None: no events. Needs the ``events`` extra.
        events_format: ``vllm`` (vLLM's current structures: maps, media ``GPU`` /
            ``STORAGE`` with ``locality``, cache groups) or ``sglang`` (SGLang's:
            positional arrays, media ``GPU`` / ``DISK`` / ``EXTERNAL``), for
            consumers that decode with one project's own structures.
        pin_system_prompts: ``prefixcache serve`` pins every request's system
            prompt (its first segment).
        explain_header: ``prefixcache serve`` sends ``X-Prefixcache-Explain`` on
            every completion: where its prompt left the stored sequences, and why.
        remote_secret: shared by the hosts of one cache: every remote value is
            authenticated (HMAC-SHA256) and token ids are encrypted (AES-GCM);
            at least 16 characters; never logged. None: values are checksummed only.
        remote_secret_file: a file holding ``remote_secret`` (instead of it).
        remote_tls_ca: CA certificate file that verifies the server (``rediss``).
        remote_tls_cert: client certificate file (``rediss``, TLS client auth).
        remote_tls_key: the client certificate's key file, if not in ``remote_tls_cert``.
        hot_tenant_floors: ``NAME=SIZE`` pairs (``b=64M,c=64M``): bytes of the hot
            tier each tenant keeps whatever the others do; eviction takes from
            the tenant most over its floor first (tiers/hot/tenants.py). A
            tenant is a store's ``tenant``, else its ``cache_salt``. Empty (the
            default): no tenant shares, nothing charged.
        hot_tenant_caps: ``NAME=SIZE`` pairs: bytes of the hot tier a tenant may
            hold; a store over it evicts that tenant's own blocks.
        ssd_tenant_floors: as ``hot_tenant_floors``, for the SSD tier's payload
            file bytes (within ``ssd_max_bytes``); kept in its index, so every
            process sharing the directory sees the same figures (tiers/ssd/shares.py).
        ssd_tenant_caps: as ``hot_tenant_caps``, for the SSD tier: a write over
            it evicts that tenant's own blocks there first, else is refused (counted).
        remote_tenant_floors: as ``hot_tenant_floors``, for the remote tier's
            stored bytes (within ``remote_max_bytes``, which the writers then keep
            by evicting; kept on the server, so every host sees the same figures:
            tiers/remote/shares.py; the server needs ``maxmemory-policy noeviction``).
        remote_tenant_caps: as ``ssd_tenant_caps``, for the remote tier.
    """

    block_size: int = 256
    hot_max_bytes: int = 4 << 30
    hot_cache_only: bool = False
    hot_run_tokens: int = 256
    eviction: Eviction = DEFAULT_EVICTION
    prefetch_bytes: int = 256 << 20
    ssd_dir: str = "~/.cache/prefixcache"
    ssd_max_bytes: int = 64 << 30
    ssd_min_free_bytes: int = 1 << 30
    ssd_run_tokens: int = 256
    ssd_run_growth: float = 0.5
    write_policy: WritePolicy = "write_back"
    write_queue_bytes: int | None = None
    queue_full: QueueFullPolicy = "drop"
    promote: bool = True
    background_quiet_ms: int = 50
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    restore_headroom: int = 256
    snapshot_interval: int = 0
    snapshot_ratio: float = 1.0
    checkpoint_tail: int = 11
    ssd_retry_seconds: float = 30.0
    counters_save_seconds: float = 5.0
    remote_url: str | None = None
    remote_prefix: str = "prefixcache"
    remote_connect_timeout_ms: int = 250
    remote_timeout_ms: int = 1000
    remote_breaker_failures: int = 3
    remote_breaker_ms: int = 5000
    remote_max_bytes: int = 0
    prefill_tokens_per_s: int = 0
    ssd_admit_after: int = 1
    ssd_write_budget: int = 0
    warm_bytes: int = 0
    events_url: str | None = None
    events_format: EventsFormat = "vllm"
    pin_system_prompts: bool = False
    explain_header: bool = True
    remote_secret: str | None = None
    remote_secret_file: str | None = None
    remote_tls_ca: str | None = None
    remote_tls_cert: str | None = None
    remote_tls_key: str | None = None
    hot_tenant_floors: str = ""
    hot_tenant_caps: str = ""
    ssd_tenant_floors: str = ""
    ssd_tenant_caps: str = ""
    remote_tenant_floors: str = ""
    remote_tenant_caps: str = ""

    def __repr__(self) -> str:
        """Every field but the secret; a password in ``remote_url`` redacted."""
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "remote_secret" and value is not None:
                value = "***"
            elif f.name == "remote_url" and value is not None:
                value = redact_url(value)
            shown.append(f"{f.name}={value!r}")
        return f"CacheConfig({', '.join(shown)})"

    def __post_init__(self) -> None:
        settings.check_types(self)
        _check_shares(self.snapshot_ratio, self.ssd_run_growth)
        for name in (
            "block_size",
            "kv_group_size",
            "remote_connect_timeout_ms",
            "remote_timeout_ms",
            "remote_breaker_failures",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in (
            "ssd_admit_after",
            "hot_max_bytes",
            "hot_run_tokens",
            "ssd_max_bytes",
            "ssd_min_free_bytes",
            "ssd_run_tokens",
            "quantized_kv_start",
            "restore_headroom",
            "remote_breaker_ms",
            "remote_max_bytes",
            "prefill_tokens_per_s",
            "snapshot_interval",
            "checkpoint_tail",
            "ssd_write_budget",
            "warm_bytes",
            "background_quiet_ms",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        queue = self.write_queue_bytes
        if queue is not None and queue < 0:  # its type: checked above
            raise ValueError(f"write_queue_bytes must be None or an int >= 0, got {queue!r}")
        for name in ("ssd_retry_seconds", "counters_save_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        # write_policy, eviction, queue_full, events_format: their Literal types, above
        check_remote(self.remote_url, self.remote_prefix)
        check_events(self.events_url)
        check_remote_trust(self)
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"kv_bits must be None or one of 2,3,4,5,6,8, got {self.kv_bits!r}")
        check_tenant_shares(self)

    @property
    def write_queue_limit(self) -> int:
        """Bytes a background writer may hold queued: ``write_queue_bytes``, or
        (None) an eighth of ``hot_max_bytes``, at least ``MIN_WRITE_QUEUE_BYTES``."""
        if self.write_queue_bytes is None:
            return max(self.hot_max_bytes // 8, MIN_WRITE_QUEUE_BYTES)
        return self.write_queue_bytes

    @property
    def ssd_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.ssd_dir))

    def replace(self, **changes: object) -> CacheConfig:
        """A copy with ``changes``; ConfigError (with its ``field``) if one is unusable."""
        return settings.build(functools.partial(dataclasses.replace, self), changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> CacheConfig:
        """Build a config from ``PREFIXCACHE_*`` variables; keyword overrides (not None) win.

        A variable that names no setting is logged at warning with the closest
        known name.

        Raises:
            ConfigError: a value is unusable; for a variable the message
                starts with ``PREFIXCACHE_X='value':``, for a keyword
                ``field`` names it.
        """
        return settings.from_env(cls, os.environ if environ is None else environ, overrides)


def _check_shares(ratio: object, growth: object) -> None:
    """``snapshot_ratio`` > 0 and ``ssd_run_growth`` from 0 to 16 (numbers, not bools)."""
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not ratio > 0:
        raise ValueError(f"snapshot_ratio must be a number > 0, got {ratio!r}")
    if not isinstance(growth, int | float) or isinstance(growth, bool) or not 0 <= growth <= 16:
        raise ValueError(f"ssd_run_growth must be a number from 0 to 16, got {growth!r}")
