"""Each tenant's share of the remote tier, kept on the server: bytes held, counters, LRU.

Several hosts write one server, so the tenants' figures live there, changed
by Lua scripts (share_scripts.py: atomic, so two writers keep them right).
A write first reserves its blocks (``reserve``): each new block is charged
to its tenant (``Block.tenant``), evicting what the floors and caps say must
go, or is refused; only the blocks that got room are written, and the
victims' keys are deleted after (removal.py), with those of any block just
written that another host evicted between its reserve and its write. The
server must not evict by itself (``maxmemory-policy noeviction``): its own
LRU knows no tenants and would leave the figures wrong. Floors and caps are
each host's own settings (arguments of the scripts); the figures are shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis

from ...config import CacheConfig
from ...shares_config import tier_shares
from ..hot.tenants import COUNTERS
from .client import RemoteClient, RemoteUnavailable
from .share_scripts import DEPTH, RELEASE, RESERVE, TAG, TOUCH

logger = logging.getLogger(__name__)


def ranked(blocks: Sequence[tuple[int, bool]]) -> tuple[int, list[int]]:
    """The uses among ``blocks`` (index in its chain, whether it continues the block
    before it) and each block's order within the call: its use's step times DEPTH
    less its index (share_scripts.py)."""
    step, orders = -1, []
    for index, continues in blocks:
        step += not (continues and orders)
        orders.append(step * DEPTH - min(max(index, 0), DEPTH - 1))
    return step + 1, orders


@dataclass(slots=True)
class Reserved:
    """What ``reserve`` decided: per block 1 (charged), 0 (held already) or -1
    (refused), and the names of the blocks evicted to make room."""

    status: list[int] = field(default_factory=list)
    victims: list[bytes] = field(default_factory=list)


class RemoteShares:
    """The floors and caps this host applies to the remote tier, and the scripts
    that keep the tenants' figures on the server.

    Args:
        client: the connection.
        prefix: ``remote_prefix``.
        budget: ``remote_max_bytes`` (0: no budget, caps only).
        floors, caps: tenant -> bytes (checked by CacheConfig).
    """

    def __init__(
        self,
        client: RemoteClient,
        prefix: str,
        budget: int,
        floors: Mapping[str, int],
        caps: Mapping[str, int],
    ) -> None:
        self.client, self.budget = client, budget
        self.floors, self.caps = dict(floors), dict(caps)
        self.base = f"{prefix}:{TAG}:"
        self._policy_checked = False
        self.owners = self.base + "owner"
        self._limits: list[object] = [budget]
        for bounds in (self.floors, self.caps):
            self._limits += [len(bounds), *(x for pair in sorted(bounds.items()) for x in pair)]

    def reserve(self, blocks: Sequence[tuple[bytes, str, int, int, bytes]]) -> Reserved:
        """Charge ``blocks`` (name, tenant, bytes, index in its chain, its parent's
        name), evicting or refusing as the shares say.

        Raises:
            RemoteUnavailable: the shard holding the figures cannot answer.
        """
        if not self._policy_checked:
            self._check_policy()
        before = [b"", *(name for name, *_ in blocks)]  # a block continues the one before
        steps, orders = ranked([(b[3], b[4] == p) for b, p in zip(blocks, before, strict=False)])
        args: list[object] = [*self._limits, steps]
        for (name, tenant, nbytes, _, _), order in zip(blocks, orders, strict=True):
            args += [name, tenant, nbytes, order]
        reply = self._run(RESERVE, args)
        num = len(blocks)
        return Reserved([int(s) for s in reply[:num]], [bytes(v) for v in reply[num:]])

    def touch(self, used: Sequence[tuple[bytes, int]]) -> None:
        """Mark these blocks (name, index in its chain; in the order restored) used
        now; a failure is ignored (the order only ages)."""
        prev = [-1, *(index for _, index in used)]
        steps, orders = ranked([(i, i == p + 1) for (_, i), p in zip(used, prev, strict=False)])
        args: list[object] = [steps]
        for (name, _), order in zip(used, orders, strict=True):
            args += [name, order]
        with contextlib.suppress(RemoteUnavailable):
            self._run(TOUCH, args)

    def kept(self) -> bool:
        """Whether the server keeps tenant figures under this prefix (any block charged).

        Raises:
            RemoteUnavailable: the shard holding the figures cannot answer.
        """
        shard = self.client.shard_of(self.owners)
        return bool(self.client.call(shard, lambda r: r.exists(self.owners)))

    def unowned(self, names: Sequence[bytes]) -> list[bytes]:
        """Those of ``names`` no tenant is charged for (another host evicted them
        between this host's reserve and its write: their keys must go).

        Raises:
            RemoteUnavailable: the shard holding the figures cannot answer.
        """
        if not names:
            return []
        shard = self.client.shard_of(self.owners)
        got = self.client.call(shard, lambda r: r.hmget(self.owners, list(names)))
        return [name for name, rec in zip(names, got, strict=True) if rec is None]

    def release(self, names: Sequence[bytes]) -> int:
        """Uncharge removed blocks; how many were charged.

        Raises:
            RemoteUnavailable: the shard holding the figures cannot answer.
        """
        return int(self._run(RELEASE, list(names))) if names else 0

    def figures(self) -> dict[str, dict[str, int]]:
        """Every tenant's figures (all hosts), with this host's floors and caps;
        empty when the server cannot answer."""

        def read(r: redis.Redis) -> tuple[list, list, list]:
            tenants = sorted(r.smembers(self.base + "tenants"))
            with r.pipeline(transaction=False) as pipe:
                for t in tenants:
                    pipe.hgetall(self.base.encode() + b"t:" + t)
                    pipe.zscore(self.base + "size", t)
                replies = pipe.execute()
            return tenants, replies[0::2], replies[1::2]

        try:
            tenants, counters, sizes = self.client.call(self.client.shard_of(self.owners), read)
        except RemoteUnavailable:
            return {}
        out: dict[str, dict[str, int]] = {}
        for raw, kept, size in zip(tenants, counters, sizes, strict=True):
            name = raw.decode(errors="replace")
            got = {k.decode(): int(v) for k, v in kept.items()}
            out[name] = {"num_blocks": got.get("num_blocks", 0), "nbytes": int(size or 0)}
            out[name] |= {c: got.get(c, 0) for c in COUNTERS}
        for name in {*self.floors, *self.caps} - set(out):
            out[name] = {"num_blocks": 0, "nbytes": 0} | dict.fromkeys(COUNTERS, 0)
        for name, figures in out.items():
            figures["floor_bytes"] = self.floors.get(name, 0)
            figures["cap_bytes"] = self.caps.get(name, -1)
        return dict(sorted(out.items()))

    def _check_policy(self) -> None:
        """Warn once if a shard evicts by itself (the figures would count what it
        dropped): shares need ``maxmemory-policy noeviction``."""
        self._policy_checked = True
        shards = self.client.shards.all()
        infos = self.client.each([(s, lambda r: r.info("memory")) for s in shards])
        policies = {str(i.get("maxmemory_policy")) for i in infos if isinstance(i, dict)} - {
            "noeviction"
        }
        if policies:
            logger.warning(
                "remote tier %s: tenant shares need maxmemory-policy noeviction, the server "
                "has %s: blocks it evicts stay counted as held (docs/remote.md)",
                self.client.url,
                ", ".join(sorted(policies)),
            )

    def _run(self, script: str, args: list[object]) -> object:
        sha = hashlib.sha1(script.encode()).hexdigest()

        def run(r: redis.Redis) -> object:
            try:
                return r.evalsha(sha, 1, self.owners, self.base, *args)
            except redis.exceptions.NoScriptError:
                return r.eval(script, 1, self.owners, self.base, *args)

        return self.client.call(self.client.shard_of(self.owners), run)


def remote_shares(config: CacheConfig, client: RemoteClient) -> RemoteShares | None:
    """The remote tier's shares of ``config``; None without remote floors or caps (the
    write path is then as without tenants: no script, no figures)."""
    floors, caps = tier_shares(config, "remote")
    if not floors and not caps:
        return None
    return RemoteShares(client, config.remote_prefix, config.remote_max_bytes, floors, caps)
