"""Children listings: a parent's children in one sorted set, ordered so that the
children sharing the most leading tokens with a prompt are its neighbours.

A member is a child's order string followed by its name. The order string
holds ``ORDER_BYTES`` per token: the head of a hash chain over the tokens,
seeded with the parent's name under a label (with ``remote_secret`` a keyed
name, so the server sees no token ids). Two children share their first n
positions exactly when they share their first n tokens (up to collisions of
the truncated hash, which cost no more than a candidate: the lookup compares
every candidate's tokens from its meta). Every member has score 0, so the set
is in byte order, and the members sharing the longest prefix with a prompt's
order string lie right before and after it: ``ZRANGEBYLEX`` and
``ZREVRANGEBYLEX`` with a limit read ``NEAREST`` on each side in O(log n) of
the set's size. A set as large as the traffic made it (a system prompt's last
block under every user turn) costs a lookup no more than a small one.
"""

from __future__ import annotations

import hashlib

from ...hashing import TOKEN_BYTES
from .names import Names

ORDER_BYTES = 4
NEAREST = 4  # members read on each side of a prompt's place in the set
_LABEL = b"prefixcache remote listing"


def order(names: Names, parent: bytes, tokens: bytes) -> bytes:
    """The order string of ``tokens`` under ``parent``."""
    state = names.name(parent + _LABEL)
    out = bytearray()
    for at in range(0, len(tokens) - len(tokens) % TOKEN_BYTES, TOKEN_BYTES):
        state = hashlib.blake2b(state + tokens[at : at + TOKEN_BYTES], digest_size=16).digest()
        out += state[:ORDER_BYTES]
    return bytes(out)


def member(names: Names, parent: bytes, tokens: bytes, key: bytes) -> bytes:
    """The member that lists block ``key`` (its ``tokens``) in ``parent``'s set."""
    return order(names, parent, tokens) + names.name(key)


def name_in(member: bytes, name_bytes: int) -> bytes:
    """The child's name at the end of ``member`` (names of one prefix and secret
    have one length)."""
    return member[-name_bytes:]


def nearest(listing: str, at: bytes, num: int = NEAREST) -> list[tuple[object, ...]]:
    """The commands that read the ``num`` members on each side of ``at`` in ``listing``."""
    return [
        ("ZRANGEBYLEX", listing, b"[" + at, b"+", "LIMIT", 0, num),
        ("ZREVRANGEBYLEX", listing, b"(" + at, b"-", "LIMIT", 0, num),
    ]
