"""Remote values signed and sealed with ``remote_secret``, so that write access to
the server cannot change what a host restores and read access does not reveal
prompts.

Without a secret a remote value carries checksums (xxh3): they catch eviction,
torn writes and mixed versions, but anyone who can write to the server can
recompute them (chain keys follow from the public hash spec, the model and the
tokens). With a secret shared by the hosts of one cache, three keys are
derived from it (HMAC-SHA256 of a label under the secret):

- **part MAC**: HMAC-SHA256 (first 16 bytes) over the block key, the part
  number, the part count and the part's bytes. HMAC-SHA256 rather than keyed
  BLAKE2b: OpenSSL's SHA-256 uses the CPU's SHA extensions (x86, Apple
  silicon) and is the faster of the two; xxh3 is no MAC.
- **meta seal**: AES-GCM (``cryptography``) over the meta's body (block key,
  parent key, token ids, part MACs, tensor specs) with its plain head and the
  block's name as associated data: the GCM tag is the meta's MAC, and token ids
  are not readable from the server. AES-GCM rather than a keyed hash of the
  tokens: the partial-block match (``hashing.common_tokens``) needs the token
  ids themselves, a keyed hash would only tell equal blocks apart.
- **names**: a block is stored under HMAC-SHA256(key, block key)[:16] instead of
  its chain key, so nobody can test whether a guessed prompt is cached.

A value that fails its MAC, or a plain value where a secret is set, raises
:class:`Forged`: a counted miss (``remote.num_forged``), never served.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Protocol

import xxhash

from ...config import CacheConfig
from ...connections import MIN_SECRET_CHARS
from ...errors import PayloadError

DIGEST_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
_LABELS = (
    b"prefixcache remote part mac",
    b"prefixcache remote meta seal",
    b"prefixcache remote names",
)


class Forged(PayloadError):
    """A remote value that fails its MAC, or carries none where a secret is set."""


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


def load_secret(config: CacheConfig) -> bytes | None:
    """``remote_secret``, or the contents of ``remote_secret_file`` (one trailing
    newline dropped), or None.

    Raises:
        ValueError: the file cannot be read or holds too short a secret (its
            path named, never its contents).
    """
    if config.remote_secret is not None:
        return config.remote_secret.encode()
    path = config.remote_secret_file
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read().removesuffix(b"\n").removesuffix(b"\r")
    except OSError as e:
        raise ValueError(f"remote_secret_file {path!r} cannot be read: {e.strerror}") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"remote_secret_file {path!r} holds {len(secret)} bytes: a secret needs at least "
            f"{MIN_SECRET_CHARS}"
        )
    return secret


class Seal:
    """The MAC, encryption and naming keys derived from one secret (thread-safe)."""

    def __init__(self, secret: bytes):
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise ImportError(
                "remote_secret needs the cryptography package: pip install 'prefixcache[remote]'"
            ) from None
        mac, seal, names = (hmac.digest(secret, label, "sha256") for label in _LABELS)
        self._mac, self._names = mac, names
        self._aead, self._invalid = AESGCM(seal), InvalidTag

    def __repr__(self) -> str:
        return "Seal(***)"

    def name(self, key: bytes) -> bytes:
        """The name block (or root) ``key`` is stored under."""
        return hmac.digest(self._names, key, "sha256")[:DIGEST_BYTES]

    def part_hasher(self, key: bytes, n: int, count: int) -> Hasher:
        """The MAC of part ``n`` of ``count`` of block ``key``, once fed its bytes."""
        return hmac.new(self._mac, key + struct.pack("<II", n, count), hashlib.sha256)

    def seal(self, body: bytes, associated: bytes) -> bytes:
        """``body`` encrypted and authenticated with ``associated``: nonce + ciphertext + tag."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, body, associated)

    def open(self, sealed: bytes, associated: bytes, what: str) -> bytes:
        """The body of a :meth:`seal` output.

        Raises:
            Forged: it was not sealed with this secret and ``associated``.
        """
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise Forged(f"{what}: sealed value truncated")
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
        except self._invalid:
            raise Forged(f"{what} fails its MAC (written without this remote_secret)") from None


def part_hasher(seal: Seal | None, key: bytes, n: int, count: int) -> Hasher:
    """The digest of a part's bytes: its MAC with a secret, else its xxh3-128."""
    return xxhash.xxh3_128() if seal is None else seal.part_hasher(key, n, count)


def digest_of(hasher: Hasher) -> bytes:
    return hasher.digest()[:DIGEST_BYTES]


def same_digest(a: bytes, b: bytes) -> bool:
    """Constant-time comparison (a MAC check must not leak how much matched)."""
    return hmac.compare_digest(a, b)
