"""Remote writes: a batch of blocks as one pipeline per shard, the shards in parallel.

A block's parts go before its meta in its shard's pipeline (a reader that finds
the meta finds the parts, unless the server evicted them since), and its name
is added to its parent's listing (``ZADD``, on the parent's shard; a listing
it takes over its bound is thinned in one more round trip: listing.py) so
that tails and the blocks a prompt diverges inside are found from the parent.
A shard that is down (or whose breaker is open) drops its blocks and only
them. The same object writes the namespace documents, adds this host's counts
to the server's counters record, removes blocks, and keeps the client-side
budget ``remote_max_bytes`` (``room``: against the servers' memory use, read
at most every ``MEMORY_CHECK_S``). Runs on the writer thread: bytes and numpy
only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import redis

from ..writer import WriteItem
from .client import RemoteClient, RemoteUnavailable
from .format import block_meta, encode_parts
from .listing import LISTING_MAX, member, over, thinning
from .names import Names, counters_key, namespace_key
from .removal import delete, stored
from .shards import Shard
from .shares import RemoteShares
from .tenant import encode_tenant

MEMORY_CHECK_S = 1.0  # how often the writer reads the servers' memory use (budget)
Command = tuple[object, ...]
Encoded = tuple[WriteItem, Shard, list[Command], int]  # item, its shard, its SETs, bytes


class RemoteWrites:
    """Sends blocks and small values to the remote server (the writer thread's).

    Args:
        client: the connection.
        names: key names (and the secret that signs the values).
        max_bytes: ``remote_max_bytes`` (0: no client-side budget).
    """

    def __init__(
        self,
        client: RemoteClient,
        names: Names,
        max_bytes: int,
        shares: RemoteShares | None = None,
    ):
        self.client, self.names, self.max_bytes = client, names, max_bytes
        self.shares = shares  # None: no tenant shares, the server's maxmemory evicts
        self.num_refused = 0  # blocks the tenant shares refused
        self.num_evicted_unsent = 0  # evicted by a later block of their own batch
        self.evicted: list[bytes] = []  # names the shares evicted (the tier drains it)
        self.listing_max = LISTING_MAX  # members a children listing keeps, about
        self._memory_checked, self._memory_used = -MEMORY_CHECK_S, 0
        self._reported: dict[str, int] = {}  # counts already added to the server's record

    def send(self, items: Sequence[WriteItem]) -> list[WriteItem]:
        """Write ``items``; the ones whose shard took them (under tenant shares,
        those the shares gave room: ``num_refused`` counts the others)."""
        names, client = self.names, self.client
        todo: list[Encoded] = []
        for item in items:
            key = item.block.key
            shard = client.shard_of(names.meta(key))
            if shard is None or not shard.breaker.allow():  # down: drop without encoding
                continue
            parts, digests = encode_parts(key, item.tensors, names)
            meta = block_meta(item.block, item.tensors, digests, names)
            sets = [("SET", names.part(key, n), part) for n, part in enumerate(parts)]
            if item.block.tenant:  # before the meta, as the parts: a reader finds it
                tenant = encode_tenant(key, item.block.tenant, names)
                sets.append(("SET", names.tenant(key), tenant))
            sets.append(("SET", names.meta(key), meta))  # after its parts
            todo.append((item, shard, sets, sum(map(len, parts)) + len(meta)))
        victims: list[bytes] = []
        if self.shares is not None:
            todo, victims = self._reserve(todo)
        blocks: dict[Shard, list[WriteItem]] = {}
        commands: dict[Shard, list[Command]] = {}
        listed: dict[Shard, list[tuple[int, str, bytes]]] = {}  # reply at, listing, member
        for item, shard, sets, _ in todo:
            commands.setdefault(shard, []).extend(sets)
            blocks.setdefault(shard, []).append(item)
            block = item.block
            listing = names.children(block.parent)
            parent = client.shard_of(listing)
            if parent is not None:
                entry = member(names, block.parent, block.tokens, block.key)
                mine = commands.setdefault(parent, [])
                mine.extend([("ZADD", listing, 0, entry), over(listing, self.listing_max)])
                listed.setdefault(parent, []).append((len(mine) - 1, listing, entry))
        shards = list(commands)
        replies = client.each([(shard, _pipeline(commands[shard])) for shard in shards])
        sent = []
        for shard, reply in zip(shards, replies, strict=True):
            if not isinstance(reply, RemoteUnavailable):
                sent += blocks.get(shard, [])
                self._thin(shard, reply, listed.get(shard, []))
        if self.shares is not None:
            self._evict(victims, [names.name(it.block.key) for it in sent])
        return sent

    def _thin(self, shard: Shard, reply: list, listed: list[tuple[int, str, bytes]]) -> None:
        """Thin the listings the batch took over their bound (listing.py), keeping the
        members just added: one more round trip, only for those listings."""
        todo: list[Command] = []
        for at, listing, entry in listed:
            if reply[at]:  # a member past the bound: the listing is over it
                thin = thinning(listing, entry, self.listing_max)
                todo += [thin, ("ZADD", listing, 0, entry)]  # the new member stays
        if todo:
            self.client.each([(shard, _pipeline(todo))])

    def _evict(self, victims: list[bytes], written: list[bytes]) -> None:
        """Delete the keys of the blocks the shares evicted, with those of the blocks
        just ``written`` that another host evicted since they were reserved."""
        assert self.shares is not None
        with contextlib.suppress(RemoteUnavailable):  # down: such keys stay until gc
            victims = victims + self.shares.unowned(written)
        if victims:  # after the writes: a reader may still be fetching one
            delete(self.client, self.names, stored(self.client, self.names, victims))
            self.evicted += victims

    def _reserve(self, todo: list[Encoded]) -> tuple[list[Encoded], list[bytes]]:
        """The blocks of ``todo`` the tenant shares give room (all dropped when the
        shard of the shares cannot answer), and the names of the blocks evicted."""
        assert self.shares is not None
        name = self.names.name
        wanted = [
            (name(it.block.key), it.block.tenant, nbytes, it.block.index, name(it.block.parent))
            for it, _, _, nbytes in todo
        ]
        try:
            got = self.shares.reserve(wanted)
        except RemoteUnavailable:
            return [], []
        gone = set(got.victims)  # a block of this batch its tenant's cap evicted again
        self.num_refused += got.status.count(-1)
        kept = []
        for encoded, (name, *_), status in zip(todo, wanted, got.status, strict=True):
            if status >= 0 and name not in gone:
                kept.append(encoded)
            elif status >= 0:
                self.num_evicted_unsent += 1
        return kept, got.victims

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
        """Delete these blocks' keys (and uncharge them under tenant shares); how
        many blocks the server held."""
        found = stored(self.client, self.names, [self.names.name(k) for k in keys])
        num = delete(self.client, self.names, found)
        if self.shares is not None:
            # when the figures' shard is down they stay charged until evicted
            with contextlib.suppress(RemoteUnavailable):
                self.shares.release([self.names.name(k) for k in keys])
        return num

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
