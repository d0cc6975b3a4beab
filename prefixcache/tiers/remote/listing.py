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

A listing stays near ``LISTING_MAX`` members: a member added to a listing
that then holds more (``over``: ``ZRANGE`` of the rank past the bound, in
the write's pipeline) makes the writer remove the members whose order
string starts in a range of ``1 / LISTING_MAX`` of the order space placed
by the new member's name (a hash: the same blocks thin the same way on every
run; ``ZREMRANGEBYLEX``), then add the new member again. The first bytes of
an order string are a hash too, so that is about ``size / LISTING_MAX``
members, old or new, live or evicted. A hot listing is never evicted by the
server, and without this it would keep the name of every child it ever had.
A listing under its bound loses no member. Over it, a member removed is a
miss for its block's partial reuse (its meta and parts stay; the chain
lookup reads a full block by key) and, for a tail, which only its parent's
listing finds, a miss until a host stores that tail again; never a wrong
block.
"""

from __future__ import annotations

import hashlib

from ...hashing import TOKEN_BYTES
from .names import Names

ORDER_BYTES = 4
NEAREST = 4  # members read on each side of a prompt's place in the set
LISTING_MAX = 1 << 14  # members a listing keeps, about
_SPACE = 1 << (8 * ORDER_BYTES)  # the first position's values
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


def over(listing: str, size: int = LISTING_MAX) -> tuple[object, ...]:
    """The command whose reply is empty unless ``listing`` holds more than ``size``
    members (read access only: the documented ACL has ``+zrange``)."""
    return ("ZRANGE", listing, size, size)


def thinning(listing: str, entry: bytes, size: int = LISTING_MAX) -> tuple[object, ...]:
    """The command that removes the members starting in a ``1 / size`` of the
    order space placed by ``entry``'s last bytes (its name's): about
    ``members / size`` of them."""
    width = max(1, _SPACE // size)
    low = int.from_bytes(entry[-ORDER_BYTES:], "big") * (_SPACE - width) // _SPACE
    high = low + width
    end = b"+" if high >= _SPACE else b"(" + high.to_bytes(ORDER_BYTES, "big")
    return ("ZREMRANGEBYLEX", listing, b"[" + low.to_bytes(ORDER_BYTES, "big"), end)
