"""What a remote tier's server holds under one prefix: blocks and bytes per namespace.

A scan of the meta keys (SCAN + MGET in chunks: the server keeps serving in
between), grouped by root key, with the namespace JSON each root stands for
and the server's memory settings. For ``prefixcache stats --remote-url``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from ...errors import PayloadError
from .format import decode_meta, namespace_key

_CHUNK = 1000


@dataclass(slots=True)
class NamespaceUsage:
    """The blocks of one namespace root on the server."""

    root: bytes
    model: str | None = None  # from the namespace JSON, if recorded
    num_blocks: int = 0
    num_tokens: int = 0
    nbytes: int = 0  # payload bytes (the parts' data)


@dataclass(slots=True)
class RemoteUsage:
    """The blocks under one prefix, per namespace, and the server's memory limits."""

    prefix: str
    namespaces: list[NamespaceUsage] = field(default_factory=list)
    num_bad: int = 0  # meta values that do not decode
    used_memory: int = 0
    maxmemory: int = 0
    policy: str = ""


def remote_usage(client: redis.Redis, prefix: str) -> RemoteUsage:
    """Scan ``prefix``'s blocks on the server behind ``client``.

    Raises:
        redis.RedisError: the server cannot be reached or refuses.
    """
    usage = RemoteUsage(prefix)
    by_root: dict[bytes, NamespaceUsage] = {}
    names = []
    for name in client.scan_iter(match=f"{prefix}:m:*", count=_CHUNK):
        names.append(name)
        if len(names) == _CHUNK:
            _add(client, names, by_root, usage)
            names = []
    _add(client, names, by_root, usage)
    roots = sorted(by_root)
    docs = client.mget([namespace_key(prefix, r) for r in roots]) if roots else []
    for root, doc in zip(roots, docs, strict=True):
        by_root[root].model = _model(doc)
    usage.namespaces = [by_root[r] for r in roots]
    memory = client.info("memory")
    usage.used_memory = int(memory.get("used_memory", 0))
    usage.maxmemory = int(memory.get("maxmemory", 0))
    usage.policy = str(memory.get("maxmemory_policy", ""))
    return usage


def _add(
    client: redis.Redis,
    names: list[bytes],
    by_root: dict[bytes, NamespaceUsage],
    usage: RemoteUsage,
) -> None:
    if not names:
        return
    for name, raw in zip(names, client.mget(names), strict=True):
        if raw is None:  # evicted since the scan saw it
            continue
        try:
            meta = decode_meta(bytes.fromhex(name.rsplit(b":", 1)[1].decode()), raw)
        except (PayloadError, ValueError):
            usage.num_bad += 1
            continue
        ns = by_root.setdefault(meta.root, NamespaceUsage(meta.root))
        ns.num_blocks += 1
        ns.num_tokens += len(meta.tokens) // 4
        ns.nbytes += meta.nbytes


def _model(doc: bytes | None) -> str | None:
    if doc is None:
        return None
    try:
        model = json.loads(doc).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None
