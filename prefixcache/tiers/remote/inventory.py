"""What a remote tier's server (or each shard of a cluster) holds under one prefix.

A scan of the meta keys on every shard (SCAN + GETs in chunks: the servers keep
serving in between), grouped by root key from the metas' plain heads (no secret
needed), with the namespace JSON each root stands for, the forged / corrupt /
missing-part blocks the hosts counted (the counters record) and each shard's
memory settings. For ``prefixcache stats --remote-url`` and ``gc``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis

from ...errors import PayloadError
from .client import RemoteClient, RemoteUnavailable
from .format import MetaHead, decode_head
from .names import REPORTED, counters_key, name_of, namespace_key
from .shards import Shard
from .shares import RemoteShares

_CHUNK = 1000


@dataclass(slots=True)
class NamespaceUsage:
    """The blocks of one namespace root on the server."""

    root: bytes
    model: str | None = None  # from the namespace JSON, if recorded
    num_blocks: int = 0
    num_tokens: int = 0
    nbytes: int = 0  # payload bytes (the parts' data)


@dataclass(frozen=True, slots=True)
class ShardUsage:
    """One server's memory use and eviction policy."""

    name: str
    used_memory: int
    maxmemory: int
    policy: str
    num_keys: int  # of every prefix


@dataclass(slots=True)
class RemoteUsage:
    """The blocks under one prefix, per namespace, and the servers' memory limits."""

    prefix: str
    namespaces: list[NamespaceUsage] = field(default_factory=list)
    shards: list[ShardUsage] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # the hosts' REPORTED counts
    num_bad: int = 0  # meta values that do not decode
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant shares (shares.py)


def scan_metas(client: RemoteClient, prefix: str) -> Iterator[tuple[Shard, bytes, bytes]]:
    """(shard, name, raw meta) of every block under ``prefix`` on every shard.

    Raises:
        RemoteUnavailable: a shard cannot be reached or refuses.
    """
    pattern = f"{prefix}:{{*}}:m"
    for shard in client.shards.all():
        keys = client.call(shard, lambda r: list(r.scan_iter(match=pattern, count=_CHUNK)))
        for i in range(0, len(keys), _CHUNK):
            batch = keys[i : i + _CHUNK]
            raws = client.call(shard, gets(batch))
            for key, raw in zip(batch, raws, strict=True):
                name = name_of(key)
                if isinstance(raw, bytes) and name is not None:  # None: evicted since the scan
                    yield shard, name, raw


def remote_usage(client: RemoteClient, prefix: str) -> RemoteUsage:
    """Scan ``prefix``'s blocks on every shard behind ``client``.

    Raises:
        RemoteUnavailable: a shard cannot be reached or refuses.
    """
    usage = RemoteUsage(prefix)
    by_root: dict[bytes, NamespaceUsage] = {}
    for _, _, raw in scan_metas(client, prefix):
        try:
            head: MetaHead = decode_head(raw)
        except PayloadError:
            usage.num_bad += 1
            continue
        ns = by_root.setdefault(head.root, NamespaceUsage(head.root))
        ns.num_blocks += 1
        ns.num_tokens += head.num_tokens
        ns.nbytes += head.nbytes
    roots = sorted(by_root)
    for root in roots:
        doc = _get(client, namespace_key(prefix, root))
        by_root[root].model = _model(doc)
    usage.namespaces = [by_root[r] for r in roots]
    name = counters_key(prefix)
    record = client.call(client.shard_of(name), lambda r: r.hgetall(name))
    usage.counters = {n: int(record.get(n.encode(), 0)) for n in REPORTED}
    shares = RemoteShares(client, prefix, 0, {}, {}).figures()  # no limits: the figures only
    for name, figures in shares.items():
        usage.tenants[name] = {k: v for k, v in figures.items() if "_bytes" not in k}
    for shard in client.shards.all():
        memory = client.call(shard, lambda r: r.info("memory"))
        num_keys = client.call(shard, lambda r: r.dbsize())
        usage.shards.append(
            ShardUsage(
                shard.name,
                int(memory.get("used_memory", 0)),
                int(memory.get("maxmemory", 0)),
                str(memory.get("maxmemory_policy", "")),
                int(num_keys),
            )
        )
    return usage


def _get(client: RemoteClient, name: str) -> bytes | None:
    try:
        return client.call(client.shard_of(name), lambda r: r.get(name))
    except RemoteUnavailable:
        return None


def gets(names: list[bytes]) -> Callable[[redis.Redis], list]:
    """GET of every name in one pipeline (error replies in their places)."""

    def run(r: redis.Redis) -> list:
        with r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(name)
            return pipe.execute(raise_on_error=False)

    return run


def _model(doc: bytes | None) -> str | None:
    if doc is None:
        return None
    try:
        model = json.loads(doc).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None
