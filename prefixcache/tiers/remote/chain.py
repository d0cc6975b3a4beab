"""A prompt's chain on the remote server: its blocks' metas, one round trip per
shard, and a parent's children nearest to the prompt.

A chain lookup asks every shard that holds one of the prompt's blocks, in
parallel, for the metas of its blocks (GET). A shard that does not answer is
a miss for its blocks (``remote_unavailable``); the others are used up to the
first block the chain lacks. The children of a block (tails, blocks the
prompt diverges inside) are read from its listing (listing.py: a sorted set
beside it, same hash tag), only the ones nearest to the rest of the prompt:
one round trip for their names, one more for the metas the chain lookup did
not bring, in parallel per shard. What a lookup costs the server does not
grow with the number of children a block has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from ...errors import MissReason, PayloadError
from .client import RemoteClient, RemoteUnavailable
from .format import RemoteMeta, decode_meta
from .listing import name_in, nearest, order
from .names import Names
from .shards import Shard, refusal

OnBad = Callable[[bytes, PayloadError], None]  # a block whose meta is unusable


@dataclass(slots=True)
class Chain:
    """What one lookup of ``keys[start:]`` found."""

    keys: Sequence[bytes]
    start: int
    metas: list[RemoteMeta]  # of keys[start:], consecutive
    stop: MissReason | None = None  # why the chain stopped, when not a plain absence
    seen: dict[bytes, RemoteMeta] = field(default_factory=dict)  # key -> meta (children too)
    bad: set[bytes] = field(default_factory=set)  # names whose metas were unusable (counted)


def look_up(
    client: RemoteClient, names: Names, keys: Sequence[bytes], start: int, on_bad: OnBad
) -> Chain:
    """The metas of ``keys[start:]`` while consecutive: one pipeline per shard, the
    shards in parallel."""
    jobs: dict[Shard | None, list[tuple[str, int, str]]] = {}
    for i in range(start, len(keys)):
        jobs.setdefault(client.shard_of(names.meta(keys[i])), []).append(
            ("GET", i, names.meta(keys[i]))
        )
    shards = list(jobs)
    replies = client.each([(shard, _pipeline(jobs[shard])) for shard in shards])
    raws: dict[int, bytes | None] = {}
    found = Chain(keys, start, [])
    down: set[int] = set()
    for shard, reply in zip(shards, replies, strict=True):
        if isinstance(reply, RemoteUnavailable):
            down.update(i for _, i, _ in jobs[shard])
            continue
        for (_, i, _), value in zip(jobs[shard], reply, strict=True):
            raws[i] = value
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
    client: RemoteClient,
    names: Names,
    parent: bytes,
    found: Chain | None,
    on_bad: OnBad,
    near: bytes | None = None,
) -> list[RemoteMeta]:
    """The metas of ``parent``'s children: with ``near`` (token bytes), only those
    nearest to it in the listing (the ones sharing the most leading tokens with
    it among them), else all; their names in one round trip, the metas ``found``
    lacks in one more per shard."""
    members = listed(client, names, parent, near)
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


def listed(client: RemoteClient, names: Names, parent: bytes, near: bytes | None) -> list[bytes]:
    """Names in ``parent``'s listing: the nearest to ``near``, or all when None."""
    listing = names.children(parent)
    if near is None:
        commands: list[tuple[object, ...]] = [("ZRANGE", listing, 0, -1)]
    else:
        commands = nearest(listing, order(names, parent, near))

    def run(r: redis.Redis) -> list:
        with r.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute()

    try:
        replies = client.call(client.shard_of(listing), run)
    except RemoteUnavailable:
        return []
    size = len(names.name(parent))
    return list(dict.fromkeys(name_in(m, size) for reply in replies for m in reply))


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
