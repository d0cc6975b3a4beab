"""Remote writes: a batch of blocks as one pipeline per shard, the shards in parallel.

A block's parts go before its meta in its shard's pipeline (a reader that finds
the meta finds the parts, unless the server evicted them since), and its name
is added to its parent's listing (``ZADD``, on the parent's shard, after the
listing's thinning: listing.py) so that tails and the blocks a prompt diverges
inside are found from the parent.
A shard that is down (or whose breaker is open) drops its blocks and only
them. The same object writes the namespace documents, adds this host's counts
to the server's counters record, removes blocks, and keeps the client-side
budget ``remote_max_bytes`` (``room``: against the servers' memory use, read
at most every ``MEMORY_CHECK_S``). Runs on the writer thread: bytes and numpy
only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from ..writer import WriteItem
from .client import RemoteClient, RemoteUnavailable
from .format import block_meta, encode_parts
from .listing import LISTING_MAX, member, thinning
from .names import Names, counters_key, namespace_key
from .removal import delete, stored
from .shards import Shard

MEMORY_CHECK_S = 1.0  # how often the writer reads the servers' memory use (budget)
Command = tuple[object, ...]


class RemoteWrites:
    """Sends blocks and small values to the remote server (the writer thread's).

    Args:
        client: the connection.
        names: key names (and the secret that signs the values).
        max_bytes: ``remote_max_bytes`` (0: no client-side budget).
    """

    def __init__(self, client: RemoteClient, names: Names, max_bytes: int):
        self.client, self.names, self.max_bytes = client, names, max_bytes
        self.listing_max = LISTING_MAX  # members a children listing keeps, about
        self._memory_checked, self._memory_used = -MEMORY_CHECK_S, 0
        self._reported: dict[str, int] = {}  # counts already added to the server's record

    def send(self, items: Sequence[WriteItem]) -> list[WriteItem]:
        """Write ``items``; the ones whose shard took them."""
        names, client = self.names, self.client
        blocks: dict[Shard, list[WriteItem]] = {}
        commands: dict[Shard, list[Command]] = {}
        for item in items:
            key = item.block.key
            shard = client.shard_of(names.meta(key))
            if shard is None or not shard.breaker.allow():  # down: drop without encoding
                continue
            parts, digests = encode_parts(key, item.tensors, names)
            meta = block_meta(item.block, item.tensors, digests, names)
            todo = commands.setdefault(shard, [])
            todo += [("SET", names.part(key, n), part) for n, part in enumerate(parts)]
            todo.append(("SET", names.meta(key), meta))  # after its parts
            blocks.setdefault(shard, []).append(item)
            block = item.block
            listing = names.children(block.parent)
            parent = client.shard_of(listing)
            if parent is not None:
                entry = member(names, block.parent, block.tokens, key)
                thin = thinning(listing, entry, self.listing_max)  # first: the new one stays
                commands.setdefault(parent, []).extend([thin, ("ZADD", listing, 0, entry)])
        shards = list(commands)
        replies = client.each([(shard, _pipeline(commands[shard])) for shard in shards])
        sent = []
        for shard, reply in zip(shards, replies, strict=True):
            if not isinstance(reply, RemoteUnavailable):
                sent += blocks.get(shard, [])
        return sent

    def put_namespaces(self, notes: dict[bytes, str]) -> bool:
        """SET the namespace documents of these roots; False if a shard failed."""
        prefix = self.names.prefix
        values = {namespace_key(prefix, root): doc.encode() for root, doc in notes.items()}
        commands: dict[Shard | None, list[Command]] = {}
        for name, value in values.items():
            commands.setdefault(self.client.shard_of(name), []).append(("SET", name, value))
        shards = list(commands)
        replies = self.client.each([(shard, _pipeline(commands[shard])) for shard in shards])
        return not any(isinstance(r, RemoteUnavailable) for r in replies)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete these blocks' keys; how many blocks the server held."""
        found = stored(self.client, self.names, [self.names.name(k) for k in keys])
        return delete(self.client, self.names, found)

    def report(self, counts: dict[str, int]) -> None:
        """Add what grew in ``counts`` (this tier's totals) since the last report to
        the server's counters record (HINCRBY: every host adds its own)."""
        delta = {n: v - self._reported.get(n, 0) for n, v in counts.items()}
        delta = {n: v for n, v in delta.items() if v}
        if delta and self._add_counters(counters_key(self.names.prefix), delta):
            self._reported = counts

    def _add_counters(self, name: str, delta: dict[str, int]) -> bool:
        """HINCRBY the hash ``name`` by ``delta``; False if its shard failed."""

        def run(client: redis.Redis) -> list:
            with client.pipeline(transaction=False) as pipe:
                for field, num in delta.items():
                    pipe.hincrby(name, field, num)
                return pipe.execute()

        try:
            self.client.call(self.client.shard_of(name), run)
        except RemoteUnavailable:
            return False
        return True

    def room(self, nbytes: int) -> bool:
        """Under ``remote_max_bytes``: the servers' memory use (read at most once a
        second, summed over the shards) leaves room for ``nbytes`` more."""
        if not self.max_bytes:
            return True
        now = time.monotonic()
        if now - self._memory_checked >= MEMORY_CHECK_S:
            shards = self.client.shards.all()
            infos = self.client.each([(s, _memory) for s in shards])
            if not infos or any(isinstance(i, RemoteUnavailable) for i in infos):
                return False
            used = sum(int(i["used_memory"]) for i in infos if isinstance(i, dict))
            self._memory_checked, self._memory_used = now, used
        if self._memory_used + nbytes > self.max_bytes:
            return False
        self._memory_used += nbytes
        return True


def _memory(client: redis.Redis) -> dict:
    return client.info("memory")


def _pipeline(commands: list[Command]) -> Callable[[redis.Redis], list]:
    def run(client: redis.Redis) -> list:
        with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute()

    return run
