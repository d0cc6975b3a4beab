"""Where the remote tier's keys live: one server, or the shards of a Redis Cluster.

``remote_url`` names one server (``redis://``, ``rediss://``, ``unix://``, as
redis-py reads them) or a cluster by some of its nodes::

    redis+cluster://[user:password@]host:port[,host:port...][?option=value]
    rediss+cluster://...                              the same over TLS

A cluster's slot map (which master serves each of the 16384 hash slots) comes
from ``CLUSTER SLOTS`` of any node that answers; each master gets a redis-py
client of its own (its own connection pool: the zero-copy reads take their
connections from it), made with the same credentials, TLS files and
timeouts. The map is read again when a call finds it stale (a node down, a
``MOVED`` reply): a replica promoted by a failover is followed by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from ...config import CacheConfig
from ...connections import redact_url

NUM_SLOTS = 16384
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed ``remote_url``."""

    url: str
    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]  # a cluster's seed nodes
    options: tuple[tuple[str, str], ...]  # a cluster URL's query options
    username: str | None = None
    password: str | None = None

    @property
    def shown(self) -> str:
        """The URL with its password redacted: the only form ever logged or reported."""
        return redact_url(self.url)


def parse_address(url: str) -> Address:
    """Parse ``remote_url``.

    Raises:
        ValueError: a cluster URL without nodes or with a bad ``host:port``.
    """
    if not url.startswith(CLUSTER_SCHEMES):
        return Address(url, False, url.startswith("rediss://"), (), ())
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    rest = rest.rstrip("/")
    user = password = None
    if "@" in rest:
        auth, _, rest = rest.rpartition("@")
        name, colon, secret = auth.partition(":")
        user, password = unquote(name) or None, unquote(secret) if colon else None
    nodes = []
    for item in filter(None, rest.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"remote_url {redact_url(url)!r}: {item!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"remote_url {redact_url(url)!r} names no cluster node (host:port)")
    options = tuple(parse_qsl(query))
    return Address(url, True, scheme == "rediss+cluster", tuple(nodes), options, user, password)


def client_options(config: CacheConfig, address: Address) -> dict[str, Any]:
    """redis-py options of every connection: timeouts, one attempt, TLS files."""
    options: dict[str, Any] = {
        "socket_timeout": config.remote_timeout_ms / 1000,
        "socket_connect_timeout": config.remote_connect_timeout_ms / 1000,
        "retry": Retry(NoBackoff(), 0),  # one attempt: the breaker decides when to try again
        "health_check_interval": 0,
    }
    if address.tls:
        files = {
            "ssl_ca_certs": config.remote_tls_ca,
            "ssl_certfile": config.remote_tls_cert,
            "ssl_keyfile": config.remote_tls_key,
        }
        options |= {name: path for name, path in files.items() if path is not None}
    return options


def server_client(address: Address, options: dict[str, Any]) -> redis.Redis:
    """The client of a single server (``remote_url`` as redis-py reads it)."""
    return redis.Redis.from_url(address.url, **options)


def node_client(address: Address, host: str, port: int, options: dict[str, Any]) -> redis.Redis:
    """The client of one cluster node."""
    extra: dict[str, Any] = dict(address.options)
    extra |= {"username": address.username, "password": address.password, "ssl": address.tls}
    return redis.Redis(host=host, port=port, **(extra | options))


def slot_map(client: redis.Redis) -> list[tuple[int, int, str, int]]:
    """(first slot, last slot, master host, master port) of every slot range, from
    ``CLUSTER SLOTS`` of the node behind ``client``.

    Raises:
        redis.RedisError: the node cannot be reached or is not in cluster mode.
    """
    out = []
    for item in client.execute_command("CLUSTER SLOTS"):
        start, end, master = item[0], item[1], item[2]
        host = master[0].decode() if isinstance(master[0], bytes) else master[0]
        out.append((int(start), int(end), host, int(master[1])))
    return out


def slot_of(redis_key: str) -> int:
    return key_slot(redis_key.encode())
