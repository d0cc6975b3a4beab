"""The connection settings' rules: the remote tier's URL, prefix, secret and TLS
files, and the KV events URL; and a URL as it may be shown (password redacted).

Checked once, by :class:`~prefixcache.config.CacheConfig` when it is made.
"""

from __future__ import annotations

import os
import re
from typing import Protocol


class TrustSettings(Protocol):
    """The settings ``check_remote_trust`` reads (CacheConfig's, read-only)."""

    @property
    def remote_url(self) -> str | None: ...
    @property
    def remote_secret(self) -> str | None: ...
    @property
    def remote_secret_file(self) -> str | None: ...
    @property
    def remote_tls_ca(self) -> str | None: ...
    @property
    def remote_tls_cert(self) -> str | None: ...
    @property
    def remote_tls_key(self) -> str | None: ...


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


def check_remote(url: str | None, prefix: str) -> None:
    if url is not None and (not isinstance(url, str) or not url.startswith(REMOTE_SCHEMES)):
        shown = redact_url(url) if isinstance(url, str) else url
        raise ValueError(f"remote_url must start with one of {REMOTE_SCHEMES}, got {shown!r}")
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " :*?[]"):
        raise ValueError(f"remote_prefix must be a non-empty name without ' :*?[]', got {prefix!r}")


EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_events(url: str | None) -> None:
    if url is not None and (not isinstance(url, str) or not url.startswith(EVENT_SCHEMES)):
        raise ValueError(f"events_url must start with one of {EVENT_SCHEMES}, got {url!r}")


def check_remote_trust(config: TrustSettings) -> None:
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
