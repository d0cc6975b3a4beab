"""Removing blocks from the remote server: a block's meta, its parts and its name in
its parent's children set.

The part count comes from the meta's plain head, the parent from its body
(readable without a secret, or with the one that sealed it; a sealed meta read
without it leaves its name in the parent's set: a dangling name is skipped by
every lookup and dropped by ``gc``). One round trip per shard to read the
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
from .names import Names
from .shards import Shard


@dataclass(frozen=True, slots=True)
class Stored:
    """A block as the server holds it: enough to delete every key of it."""

    name: bytes
    num_parts: int
    parent: bytes | None  # None: unknown (a sealed meta without the secret)


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
        parent: bytes | None = decode_meta(name, raw, names).parent
    except PayloadError:
        parent = None
    return Stored(name, head.num_parts, parent)


def delete(client: RemoteClient, names: Names, blocks: Sequence[Stored]) -> int:
    """Delete every key of ``blocks`` (and their names from their parents' sets);
    how many blocks' keys were deleted."""
    groups: dict[Shard | None, list[tuple[str, ...]]] = {}
    owners: dict[Shard | None, int] = {}
    for block in blocks:
        meta = names.of_name(block.name, "m")
        shard = client.shard_of(meta)
        parts = [names.of_name(block.name, f"p:{n}") for n in range(block.num_parts)]
        groups.setdefault(shard, []).append(("UNLINK", meta, *parts))
        owners[shard] = owners.get(shard, 0) + 1
        if block.parent is not None:
            listing = names.children(block.parent)
            groups.setdefault(client.shard_of(listing), []).append(("SREM", listing, block.name))
    shards = list(groups)
    replies = client.each([(s, _run(groups[s])) for s in shards])
    return sum(
        owners.get(s, 0)
        for s, reply in zip(shards, replies, strict=True)
        if not isinstance(reply, RemoteUnavailable)
    )


def _run(commands: list[tuple[str, ...]]) -> Callable[[redis.Redis], list]:
    def run(client: redis.Redis) -> list:
        with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=False)

    return run
