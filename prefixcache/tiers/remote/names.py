"""Key names on the remote server: a block's keys under its name in braces (a Redis
Cluster hash tag: its meta, parts and children listing live on one shard), and the
keys of the namespace documents and of the hosts' counters record.

A block's name is its chain key, or with ``remote_secret`` a keyed hash of it
(``Seal.name``): nobody without the secret can tell which prompts are stored.
"""

from __future__ import annotations

from .seal import Seal


class Names:
    """The server's key strings of blocks under one prefix (and secret)."""

    def __init__(self, prefix: str, seal: Seal | None = None):
        self.prefix, self.seal = prefix, seal

    def name(self, key: bytes) -> bytes:
        return key if self.seal is None else self.seal.name(key)

    def meta(self, key: bytes) -> str:
        return f"{self.prefix}:{{{self.name(key).hex()}}}:m"

    def part(self, key: bytes, n: int) -> str:
        return f"{self.prefix}:{{{self.name(key).hex()}}}:p:{n}"

    def tenant(self, key: bytes) -> str:
        """The tenant a block is charged to (format.py; absent: the default tenant)."""
        return f"{self.prefix}:{{{self.name(key).hex()}}}:t"

    def children(self, key: bytes) -> str:
        """The listing of ``key``'s children (``key``: a block or a root; listing.py)."""
        return f"{self.prefix}:{{{self.name(key).hex()}}}:l"

    def of_name(self, name: bytes, suffix: str) -> str:
        return f"{self.prefix}:{{{name.hex()}}}:{suffix}"


def namespace_key(prefix: str, root: bytes) -> str:
    return f"{prefix}:ns:{root.hex()}"


# what every host adds up in the server's counters record (a hash)
REPORTED = ("num_forged", "num_corrupt", "num_missing_parts")


def counters_key(prefix: str) -> str:
    return f"{prefix}:counters"


def name_of(redis_key: bytes) -> bytes | None:
    """The name in a key ``{prefix}:{name hex}:...``, or None when it has none."""
    start, end = redis_key.find(b"{"), redis_key.find(b"}")
    try:
        return bytes.fromhex(redis_key[start + 1 : end].decode()) if 0 <= start < end else None
    except ValueError:
        return None
