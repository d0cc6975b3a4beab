"""Removing blocks from the remote server: a block's meta, its parts, its tenant and
its member in its parent's children listing.

The part count comes from the meta's plain head, the parent and tokens from
its body (readable without a secret, or with the one that sealed it; a sealed
meta read without it leaves its member in the parent's listing: a dangling
name is skipped by every lookup and dropped by ``gc``). One round trip per shard to read the
metas, one to delete, the shards in parallel. Used by ``RemoteTier.remove``
(on the writer thread) and ``prefixcache gc --remote-url``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from ...errors import PayloadError
from .client import RemoteClient, RemoteUnavailable
from .format import decode_head, decode_meta
from .listing import order
from .names import Names
from .shards import Shard


@dataclass(frozen=True, slots=True)
class Stored:
    """A block as the server holds it: enough to delete every key of it."""

    name: bytes
    num_parts: int
    parent: bytes | None  # None: unknown (a sealed meta without the secret)
    tokens: bytes = b""  # the block's token ids (its member in the parent's listing)


def stored(client: RemoteClient, names: Names, stored_names: Sequence[bytes]) -> list[Stored]:
    """The blocks of ``stored_names`` whose metas the server holds."""
    groups: dict[Shard | None, list[bytes]] = {}
    for name in stored_names:
        groups.setdefault(client.shard_of(names.of_name(name, "m")), []).append(name)
    shards = list(groups)
    jobs = [(s, _run([("GET", names.of_name(n, "m")) for n in groups[s]])) for s in shards]
    out = []
    for shard, reply in zip(shards, client.each(jobs), strict=True):
        if isinstance(reply, RemoteUnavailable):
            continue
        for name, raw in zip(groups[shard], reply, strict=True):
            if isinstance(raw, bytes):
                out.append(_stored(name, raw, names))
    return out


def _stored(name: bytes, raw: bytes, names: Names) -> Stored:
    try:
        head = decode_head(raw)
    except PayloadError:
        return Stored(name, 0, None)
    try:
        meta = decode_meta(name, raw, names)
    except PayloadError:
        return Stored(name, head.num_parts, None)
    return Stored(name, head.num_parts, meta.parent, meta.tokens)


def delete(client: RemoteClient, names: Names, blocks: Sequence[Stored]) -> int:
    """Delete every key of ``blocks`` (and their members from their parents' listings);
    how many blocks' keys were deleted."""
    groups: dict[Shard | None, list[tuple[object, ...]]] = {}
    owners: dict[Shard | None, int] = {}
    for block in blocks:
        meta = names.of_name(block.name, "m")
        shard = client.shard_of(meta)
        parts = [names.of_name(block.name, f"p:{n}") for n in range(block.num_parts)]
        tenant = names.of_name(block.name, "t")
        groups.setdefault(shard, []).append(("UNLINK", meta, tenant, *parts))
        owners[shard] = owners.get(shard, 0) + 1
        if block.parent is not None:
            listing = names.children(block.parent)
            entry = _member(names, block)
            groups.setdefault(client.shard_of(listing), []).append(("ZREM", listing, entry))
    shards = list(groups)
    replies = client.each([(s, _run(groups[s])) for s in shards])
    return sum(
        owners.get(s, 0)
        for s, reply in zip(shards, replies, strict=True)
        if not isinstance(reply, RemoteUnavailable)
    )


def _member(names: Names, block: Stored) -> bytes:
    """``block``'s member in its parent's listing (listing.py)."""
    assert block.parent is not None
    return order(names, block.parent, block.tokens) + block.name


def _run(commands: list[tuple[object, ...]]) -> Callable[[redis.Redis], list]:
    def run(client: redis.Redis) -> list:
        with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=False)

    return run
