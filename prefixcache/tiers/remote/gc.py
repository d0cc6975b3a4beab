"""``prefixcache gc --remote-url``: what to remove from a remote server, and removing it.

Selected blocks: a model's (``--model``), or those not read for a while
(``--older-than``: the server's idle time of their meta key, which every
lookup reads), and every block below a selected one (found through the
children listings: unreachable once their parent goes). Always: parts and tenants whose
meta is gone (the server evicted or a host removed it), members of children
listings whose block is gone, and the children sets an older version kept
(``:c``, no longer read). The server's own LRU (``maxmemory``) keeps it under its
size: there is no ``--max-bytes`` here. Needs no secret: the metas' plain heads
are enough.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from ...errors import PayloadError
from .client import RemoteClient
from .format import decode_head
from .inventory import gets, scan_metas
from .listing import name_in
from .names import Names, name_of
from .removal import Stored, delete
from .shards import Shard
from .shares import RemoteShares

_CHUNK = 1000


@dataclass(slots=True)
class RemoteGc:
    """What :func:`plan_gc` chose."""

    remove: list[Stored] = field(default_factory=list)
    num_selected: int = 0
    num_below: int = 0
    nbytes: int = 0
    num_tokens: int = 0
    stray_keys: list[tuple[Shard, bytes]] = field(default_factory=list)  # orphan parts, sets
    dangling: list[tuple[Shard, bytes, bytes]] = field(default_factory=list)  # listing, member


def plan_gc(
    client: RemoteClient, names: Names, *, model: str | None, older_than: float | None
) -> RemoteGc:
    """Choose what to remove (reads only).

    Raises:
        RemoteUnavailable: a shard cannot be reached or refuses.
    """
    heads, where = {}, {}
    for shard, name, raw in scan_metas(client, names.prefix):
        try:
            heads[name], where[name] = decode_head(raw), shard
        except PayloadError:
            heads[name], where[name] = None, shard
    roots = _roots(client, names.prefix, model) if model is not None else None
    chosen = {n for n, h in heads.items() if h is not None and (roots is None or h.root in roots)}
    if older_than is not None:
        chosen = {n for n in chosen if _idle(client, where[n], names, n) > older_than}
    elif model is None:
        chosen = set()
    plan = RemoteGc(num_selected=len(chosen))
    kids = _children(client, names, where)
    todo, below = list(chosen), set(chosen)
    while todo:
        for child in kids.get(todo.pop(), {}).values():
            if child in heads and child not in below:
                below.add(child)
                todo.append(child)
    plan.num_below = len(below) - len(chosen)
    for name in below:
        head = heads[name]
        plan.remove.append(Stored(name, head.num_parts if head else 0, None))
        plan.nbytes += head.nbytes if head else 0
        plan.num_tokens += head.num_tokens if head else 0
    for owner, members in kids.items():  # names of blocks gone or going
        listing = names.of_name(owner, "l").encode()
        if owner in below:
            plan.stray_keys.append((where[owner], listing))
            continue
        for entry, child in members.items():
            if child not in heads or child in below:
                plan.dangling.append((where[owner], listing, entry))
    plan.stray_keys += _stray_parts(client, names.prefix, heads)
    plan.stray_keys += _old_sets(client, names.prefix)
    return plan


def run_gc(client: RemoteClient, names: Names, plan: RemoteGc) -> int:
    """Remove what ``plan`` chose; how many blocks went (uncharged from their
    tenants as removed when the server keeps tenant shares: shares.py)."""
    num = delete(client, names, plan.remove)
    shares = RemoteShares(client, names.prefix, 0, {}, {})
    if plan.remove and shares.kept():
        shares.release([block.name for block in plan.remove])
    for shard, key in plan.stray_keys:
        client.call(shard, lambda r, key=key: r.unlink(key))
    for shard, listing, member in plan.dangling:
        client.call(shard, lambda r, listing=listing, member=member: r.zrem(listing, member))
    return num


def _roots(client: RemoteClient, prefix: str, model: str) -> set[bytes]:
    """Roots whose namespace document names ``model`` (or whose hex starts with it)."""
    out = set()
    for shard in client.shards.all():
        keys = client.call(shard, _scan(f"{prefix}:ns:*"))
        docs = client.call(shard, gets(keys)) if keys else []
        for key, doc in zip(keys, docs, strict=True):
            root_hex = key.rsplit(b":", 1)[1].decode()
            try:
                named = json.loads(doc).get("model") if isinstance(doc, bytes) else None
            except (ValueError, AttributeError):
                named = None
            if named == model or (len(model) >= 4 and root_hex.startswith(model.lower())):
                out.add(bytes.fromhex(root_hex))
    return out


def _idle(client: RemoteClient, shard: Shard, names: Names, name: bytes) -> float:
    """Seconds since block ``name``'s meta was last read or written (the server's clock)."""
    key = names.of_name(name, "m")
    idle = client.call(shard, lambda r: r.object("idletime", key))
    return float(idle or 0)


def _children(client: RemoteClient, names: Names, where: dict) -> dict[bytes, dict[bytes, bytes]]:
    """Every children listing under the prefix: owner name -> {member: child name}."""
    out: dict[bytes, dict[bytes, bytes]] = {}
    for shard in client.shards.all():
        keys = client.call(shard, _scan(f"{names.prefix}:{{*}}:l"))
        for key in keys:
            owner = name_of(key)
            if owner is not None:
                entries = client.call(shard, lambda r, key=key: r.zrange(key, 0, -1))
                out[owner] = {e: name_in(e, len(owner)) for e in entries}
                where.setdefault(owner, shard)
    return out


def _old_sets(client: RemoteClient, prefix: str) -> list[tuple[Shard, bytes]]:
    """The children sets an older version wrote (``:c``): nothing reads them now."""
    scan = _scan(f"{prefix}:{{*}}:c")
    return [(s, key) for s in client.shards.all() for key in client.call(s, scan)]


def _stray_parts(client: RemoteClient, prefix: str, heads: dict) -> list[tuple[Shard, bytes]]:
    out = []
    for shard in client.shards.all():
        for pattern in (f"{prefix}:{{*}}:p:*", f"{prefix}:{{*}}:t"):
            for key in client.call(shard, _scan(pattern)):
                if name_of(key) not in heads:
                    out.append((shard, key))
    return out


def _scan(pattern: str) -> Callable[[redis.Redis], list[bytes]]:
    return lambda r: list(r.scan_iter(match=pattern, count=_CHUNK))
