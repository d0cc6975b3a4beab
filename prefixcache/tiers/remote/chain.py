"""A prompt's chain on the remote server: its blocks' metas and children, one round
trip per shard.

A chain lookup asks every shard that holds one of the prompt's blocks, in
parallel, for the metas of its blocks (GET) and their children sets
(SMEMBERS; a block's set lives beside it, same hash tag), and the set of the
block before the first asked. Wherever the chain stops, the children of the
last block found (tails, blocks the prompt diverges inside) are then known by
name without another round trip; their metas take one more, in parallel per
shard, only when there are some. A shard that does not answer is a miss for
its blocks (``remote_unavailable``); the others are used up to the first
block the chain lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from ...errors import MissReason, PayloadError
from .client import RemoteClient, RemoteUnavailable
from .format import RemoteMeta, decode_meta
from .names import Names
from .shards import Shard, refusal

OnBad = Callable[[bytes, PayloadError], None]  # a block whose meta is unusable


@dataclass(slots=True)
class Chain:
    """What one lookup of ``keys[start:]`` found."""

    keys: Sequence[bytes]
    start: int
    metas: list[RemoteMeta]  # of keys[start:], consecutive
    children: dict[bytes, set[bytes]] = field(default_factory=dict)  # key -> child names
    stop: MissReason | None = None  # why the chain stopped, when not a plain absence
    seen: dict[bytes, RemoteMeta] = field(default_factory=dict)  # key -> meta (children too)
    bad: set[bytes] = field(default_factory=set)  # names whose metas were unusable (counted)


def look_up(
    client: RemoteClient, names: Names, keys: Sequence[bytes], start: int, on_bad: OnBad
) -> Chain:
    """The metas of ``keys[start:]`` while consecutive, and the children sets of
    ``keys[start - 1:]``: one pipeline per shard, the shards in parallel."""
    jobs: dict[Shard | None, list[tuple[str, int, str]]] = {}
    for i in range(max(start - 1, 0), len(keys)):
        shard = client.shard_of(names.meta(keys[i]))
        if i >= start:
            jobs.setdefault(shard, []).append(("GET", i, names.meta(keys[i])))
        jobs.setdefault(shard, []).append(("SMEMBERS", i, names.children(keys[i])))
    shards = list(jobs)
    replies = client.each([(shard, _pipeline(jobs[shard])) for shard in shards])
    raws: dict[int, bytes | None] = {}
    found = Chain(keys, start, [])
    down: set[int] = set()
    for shard, reply in zip(shards, replies, strict=True):
        if isinstance(reply, RemoteUnavailable):
            down.update(i for _, i, _ in jobs[shard])
            continue
        for (command, i, _), value in zip(jobs[shard], reply, strict=True):
            if command == "GET":
                raws[i] = value
            elif not isinstance(value, Exception):
                found.children[keys[i]] = set(value)
    for i in range(start, len(keys)):
        if i in down:
            found.stop = MissReason.REMOTE_UNAVAILABLE
            break
        raw = raws.get(i)
        if raw is None:
            break
        try:
            if isinstance(raw, Exception):  # e.g. a key of another type: WRONGTYPE
                raise PayloadError(f"remote meta of {keys[i].hex()}: {raw}")
            meta = decode_meta(names.name(keys[i]), raw, names, keys[i])
        except PayloadError as e:
            on_bad(keys[i], e)
            found.bad.add(names.name(keys[i]))
            break
        found.metas.append(meta)
        found.seen[meta.key] = meta
    return found


def children_of(
    client: RemoteClient, names: Names, parent: bytes, found: Chain | None, on_bad: OnBad
) -> list[RemoteMeta]:
    """The metas of ``parent``'s children: their names from ``found`` (else one
    more round trip), the metas ``found`` lacks in one round trip per shard."""
    members = found.children.get(parent) if found is not None else None
    if members is None:
        key = names.children(parent)
        try:
            members = client.call(client.shard_of(key), lambda r: r.smembers(key))
        except RemoteUnavailable:
            return []
    known = {names.name(k): m for k, m in found.seen.items()} if found is not None else {}
    bad = found.bad if found is not None else set()
    out = [known[n] for n in members if n in known]
    jobs: dict[Shard | None, list[tuple[str, bytes, str]]] = {}
    for name in members:
        if name not in known and name not in bad and len(name) == len(parent):
            meta_key = names.of_name(name, "m")
            jobs.setdefault(client.shard_of(meta_key), []).append(("GET", name, meta_key))
    shards = list(jobs)
    replies = client.each([(shard, _pipeline(jobs[shard])) for shard in shards])
    for shard, reply in zip(shards, replies, strict=True):
        if isinstance(reply, RemoteUnavailable):
            continue
        for (_, name, _), raw in zip(jobs[shard], reply, strict=True):
            if raw is None:  # evicted or removed since it was listed
                continue
            try:
                if isinstance(raw, Exception):
                    raise PayloadError(f"remote meta {name.hex()}: {raw}")
                meta = decode_meta(name, raw, names)
            except PayloadError as e:
                on_bad(name, e)
                if found is not None:
                    found.bad.add(name)
                continue
            if meta.parent == parent:
                out.append(meta)
                if found is not None:
                    found.seen[meta.key] = meta
    return out


def _pipeline(commands: list[tuple[str, object, str]]) -> Callable[[redis.Redis], list]:
    """One pipeline of ``commands``; an error reply stays in its place in the
    replies unless it says the user is refused (raised: it turns the tier off)."""

    def run(client: redis.Redis) -> list:
        with client.pipeline(transaction=False) as pipe:
            for command, _, key in commands:
                pipe.execute_command(command, key)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, redis.RedisError) and refusal(reply) is not None:
                raise reply
        return replies

    return run
