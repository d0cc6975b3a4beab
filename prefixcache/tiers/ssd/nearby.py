"""A parent's children ordered by their tokens, so that a lookup near a prompt
reads only a few of them, however many the parent has.

The ``nearby`` database of the index holds, for every indexed block, the key
``parent + order(tokens) + key`` (value: the block's key). The order string
holds ``ORDER_BYTES`` per token for the first ``ORDER_TOKENS`` tokens: the head
of a hash chain over them, so two children share their first n positions
exactly when they share their first n tokens (up to collisions of the
truncated hash). The children sharing the most leading tokens with a prompt
therefore lie right before and after the prompt's own place: a cursor's
``set_range`` finds it in O(log n) and ``NEAREST`` entries are read on each
side. The caller compares every candidate's real tokens, so a collision costs
a candidate, never returns a wrong block. Beyond ``ORDER_TOKENS`` shared tokens
children are in key order: among many that share that much with a prompt the
nearest read may not be the longest match (less reuse, never a wrong one).
An LMDB key is at most 511 bytes: 16-byte keys leave room for the order string.
"""

from __future__ import annotations

import lmdb
import xxhash

from ...hashing import TOKEN_BYTES

ORDER_BYTES = 3
ORDER_TOKENS = 128
NEAREST = 4  # entries read on each side of a prompt's place
DB = "nearby"


def order(tokens: bytes) -> bytes:
    """The order string of ``tokens`` (uint32 bytes): one hash chain step per token."""
    digest = xxhash.xxh3_64_digest
    state = b""
    out = bytearray()
    end = min(len(tokens) // TOKEN_BYTES, ORDER_TOKENS) * TOKEN_BYTES
    for at in range(0, end, TOKEN_BYTES):
        state = digest(state + tokens[at : at + TOKEN_BYTES])
        out += state[:ORDER_BYTES]
    return bytes(out)


def entry(parent: bytes, tokens: bytes, key: bytes) -> bytes:
    """The ``nearby`` key of block ``key`` (its ``tokens``) under ``parent``."""
    return parent + order(tokens) + key


def around(cur: lmdb.Cursor, parent: bytes, near: bytes, num: int = NEAREST) -> list[bytes]:
    """Keys of the ``num`` children of ``parent`` on each side of ``near``'s place."""
    at = parent + order(near)
    out: list[bytes] = []
    found = cur.set_range(at)
    ok = found
    while ok and len(out) < num and cur.key().startswith(parent):
        out.append(bytes(cur.value()))
        ok = cur.next()
    ok = cur.set_range(at) and cur.prev() if found else cur.last()
    for _ in range(num):
        if not ok or not cur.key().startswith(parent):
            break
        out.append(bytes(cur.value()))
        ok = cur.prev()
    return out


def complete(txn: lmdb.Transaction, blocks: object, nearby: object) -> bool:
    """Whether every indexed block has its ``nearby`` entry (O(1): the counts)."""
    return txn.stat(blocks)["entries"] == txn.stat(nearby)["entries"]
