"""CacheConfig: every setting of a PrefixCache, loadable from PREFIXCACHE_* env vars."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Literal

WritePolicy = Literal["write_back", "write_through"]
WRITE_POLICIES = ("write_back", "write_through")
QueueFullPolicy = Literal["drop", "inline"]
QUEUE_FULL_POLICIES = ("drop", "inline")
ENV_PREFIX = "PREFIXCACHE_"

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``8G``, ``512MiB``, ``1048576`` into bytes."""
    if isinstance(text, int):
        return text
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    num = raw.rstrip("kmgt")
    unit = raw[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r}") from None
    if unit not in _SIZE_UNITS or value < 0:
        raise ValueError(f"not a byte size: {text!r}")
    return int(value * _SIZE_UNITS[unit])


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Settings of a PrefixCache. The same names are CLI flags and env vars.

    Attributes:
        block_size: tokens per block; only full blocks are cached.
        hot_max_bytes: byte budget of the hot tier (live arrays in RAM).
        hot_cache_only: keep everything in RAM; no SSD directory, no disk I/O.
        ssd_dir: directory of the SSD tier (LMDB index + payload files).
        ssd_max_bytes: byte budget of the SSD tier's payloads.
        ssd_min_free_bytes: free disk space the SSD tier always leaves.
        write_policy: ``write_back`` spills on hot eviction; ``write_through``
            writes every stored block at once.
        write_queue_bytes: bound of the background writer's queue.
        queue_full: ``drop`` (count and skip) or ``inline`` (write on the
            caller's thread) when the queue is full.
        promote: copy SSD hits into the hot tier when it has room.
        kv_bits: KV quantization bits (as mlx-lm's ``kv_bits``), or None.
        kv_group_size: KV quantization group size.
        quantized_kv_start: cache length from which mlx-lm quantizes.
        restore_headroom: extra tokens of buffer a restored cache gets beyond
            the prompt, so decoding does not re-allocate at once.
        snapshot_interval: during prefill, a restore point every N blocks: a
            recurrent-state snapshot, and sliding-window K/V in the blocks its
            window covers; 0 (the default) picks N from ``snapshot_ratio``. The
            end of every stored sequence is a restore point whatever N is.
        snapshot_ratio: with ``snapshot_interval=0``, what interval points keep
            (snapshot and window K/V bytes) is at most this multiple of the
            full-attention K/V bytes of the blocks they sit on (N = ceil(point
            bytes / (ratio * K/V bytes of a block))); a model without
            full-attention layers has a restore point at every block.
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
            this (0: leave it to the server's ``maxmemory``).
        prefill_tokens_per_s: recompute speed the remote cost gate compares a
            remote restore with (0: measured by ``PrefixCache.prefill``).
        remote_secret: shared by the hosts of one cache: every remote value is
            authenticated (HMAC-SHA256) and token ids are encrypted (AES-GCM);
            at least 16 characters; never logged. None: values are checksummed only.
        remote_secret_file: a file holding ``remote_secret`` (instead of it).
        remote_tls_ca: CA certificate file that verifies the server (``rediss``).
        remote_tls_cert: client certificate file (``rediss``, TLS client auth).
        remote_tls_key: the client certificate's key file, if not in ``remote_tls_cert``.
    """

    block_size: int = 256
    hot_max_bytes: int = 4 << 30
    hot_cache_only: bool = False
    ssd_dir: str = "~/.cache/prefixcache"
    ssd_max_bytes: int = 64 << 30
    ssd_min_free_bytes: int = 1 << 30
    write_policy: WritePolicy = "write_back"
    write_queue_bytes: int = 512 << 20
    queue_full: QueueFullPolicy = "drop"
    promote: bool = True
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    restore_headroom: int = 256
    snapshot_interval: int = 0
    snapshot_ratio: float = 1.0
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
    remote_secret: str | None = None
    remote_secret_file: str | None = None
    remote_tls_ca: str | None = None
    remote_tls_cert: str | None = None
    remote_tls_key: str | None = None

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
        ratio = self.snapshot_ratio
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not ratio > 0:
            raise ValueError(f"snapshot_ratio must be a number > 0, got {ratio!r}")
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
            "hot_max_bytes",
            "ssd_max_bytes",
            "ssd_min_free_bytes",
            "write_queue_bytes",
            "quantized_kv_start",
            "restore_headroom",
            "remote_breaker_ms",
            "remote_max_bytes",
            "prefill_tokens_per_s",
            "snapshot_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("ssd_retry_seconds", "counters_save_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}"
            )
        if self.queue_full not in QUEUE_FULL_POLICIES:
            raise ValueError(
                f"queue_full must be one of {QUEUE_FULL_POLICIES}, got {self.queue_full!r}"
            )
        _check_remote(self.remote_url, self.remote_prefix)
        _check_remote_trust(self)
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"kv_bits must be None or one of 2,3,4,5,6,8, got {self.kv_bits!r}")

    @property
    def ssd_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.ssd_dir))

    def replace(self, **changes: object) -> CacheConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> CacheConfig:
        """Build a config from ``PREFIXCACHE_*`` variables; keyword overrides win."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _parse_field(field.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse_field(name: str, raw: str) -> object:
    if name in ("hot_cache_only", "promote"):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()} must be a boolean, got {raw!r}")
    if name.endswith("_bytes"):
        return parse_bytes(raw)
    if name in ("ssd_dir", "write_policy", "queue_full", "remote_prefix"):
        return raw
    if name in _REMOTE_FILES or name == "remote_secret":
        return raw.strip() or None
    if name.endswith("_seconds"):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()} must be seconds, got {raw!r}") from None
    if name == "remote_url":
        return raw.strip() or None
    if name == "kv_bits" and raw.strip().lower() in ("", "none"):
        return None
    if name == "snapshot_ratio":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()} must be a number, got {raw!r}") from None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()} must be an int, got {raw!r}") from None


REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
MIN_SECRET_CHARS = 16
_REMOTE_FILES = ("remote_secret_file", "remote_tls_ca", "remote_tls_cert", "remote_tls_key")


def redact_url(url: str) -> str:
    """``url`` with its password (``scheme://user:password@...``, ``?password=``) as ``***``."""
    scheme, sep, rest = url.partition("://")
    query = rest.find("?")
    at = rest.rfind("@", 0, query if query >= 0 else len(rest))
    if sep and at >= 0:
        user = rest[:at].partition(":")[0]
        rest = f"{user}:***{rest[at:]}" if ":" in rest[:at] else rest
    return re.sub(r"([?&]password=)[^&]*", r"\1***", f"{scheme}{sep}{rest}")


def _check_remote(url: str | None, prefix: str) -> None:
    if url is not None and (not isinstance(url, str) or not url.startswith(REMOTE_SCHEMES)):
        shown = redact_url(url) if isinstance(url, str) else url
        raise ValueError(f"remote_url must start with one of {REMOTE_SCHEMES}, got {shown!r}")
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " :*?[]"):
        raise ValueError(f"remote_prefix must be a non-empty name without ' :*?[]', got {prefix!r}")


def _check_remote_trust(config: CacheConfig) -> None:
    """The secret and TLS settings: well-formed, files that exist, TLS only with ``rediss``."""
    secret = config.remote_secret
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            got = f"{len(secret)} characters" if isinstance(secret, str) else type(secret).__name__
            raise ValueError(
                f"remote_secret must be a string of at least {MIN_SECRET_CHARS} characters, "
                f"got {got}"
            )  # the secret itself is never shown
        if config.remote_secret_file is not None:
            raise ValueError("remote_secret and remote_secret_file are both set: give one")
    for name in _REMOTE_FILES:
        path = getattr(config, name)
        if path is not None and (not isinstance(path, str) or not os.path.isfile(path)):
            raise ValueError(f"{name} must name an existing file, got {path!r}")
    tls = [n for n in _REMOTE_FILES[1:] if getattr(config, n) is not None]
    url = config.remote_url or ""
    if tls and not url.startswith(("rediss://", "rediss+cluster://")):
        raise ValueError(
            f"{', '.join(tls)} given but remote_url {redact_url(url)!r} does not use TLS "
            "(rediss:// or rediss+cluster://)"
        )
    if config.remote_tls_key is not None and config.remote_tls_cert is None:
        raise ValueError("remote_tls_key is set without remote_tls_cert")
