"""The shards of the remote tier and their breakers: one for a single server, one per
master of a cluster, found from the cluster's slot map.

The slot map is read on first use and again, at most every ``REREAD_S``, after
a call found it stale (a shard unreachable or skipped, a ``MOVED`` reply; when
no node answers at all, not before ``remote_breaker_ms``): until a failover
promotes a replica the map names the dead master and its keys stay misses;
once the cluster has promoted it, the next read names the replica and its keys
are served again, with no restart.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable

import redis

from ...config import CacheConfig
from .topology import (
    NUM_SLOTS,
    client_options,
    node_client,
    parse_address,
    server_client,
    slot_map,
    slot_of,
)

REREAD_S = 0.25


class Refused(Exception):
    """The server turned this client away for a reason retrying cannot fix."""

    def __init__(self, why: str, error: BaseException):
        super().__init__(f"{why} ({error})")
        self.why, self.error = why, error


def refusal(error: BaseException) -> str | None:
    """Why ``error`` means a wrong setting (not an outage), or None."""
    if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        text = str(error)
        if "HELLO must be called" in text or "Authentication required" in text:
            return "the server needs a password and remote_url gives none"
        return "the server refused the login (wrong password or user)"
    if isinstance(error, redis.exceptions.NoPermissionError):
        return "the user may not use the cache's keys or commands (ACL)"
    cause = error.__cause__ or error.__context__
    if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(error):
        return "the server's TLS certificate does not verify (remote_tls_ca)"
    return None


class Breaker:
    """Consecutive-failure circuit breaker (thread-safe)."""

    def __init__(self, failures: int, open_seconds: float, clock: Callable[[], float]):
        self.failures, self.open_seconds, self.clock = failures, open_seconds, clock
        self.num_trips = 0
        self._consecutive = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self.clock() < self._open_until

    def allow(self) -> bool:
        return not self.is_open

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._consecutive < self.failures:
                return False
            self._open_until = self.clock() + self.open_seconds
            self.num_trips += 1
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._open_until = 0.0


class Shard:
    """One server: its name (``host:port``, or the redacted URL), client and breaker."""

    def __init__(self, name: str, client: redis.Redis, breaker: Breaker):
        self.name, self.redis, self.breaker = name, client, breaker

    def __repr__(self) -> str:
        return f"Shard({self.name})"


class ShardMap:
    """Which shard serves a key (thread-safe)."""

    def __init__(self, config: CacheConfig, clock: Callable[[], float]):
        self.address = parse_address(config.remote_url or "")
        self.options = client_options(config, self.address)
        self.num_reads = 0  # slot map reads
        self._breaker = lambda: Breaker(
            config.remote_breaker_failures, config.remote_breaker_ms / 1000, clock
        )
        self._clock = clock
        self._retry_s = max(config.remote_breaker_ms / 1000, REREAD_S)  # no node answered
        self._lock = threading.Lock()
        self._shards: dict[str, Shard] = {}
        self._slots: list[Shard | None] = []
        self._stale_since: float | None = 0.0  # read the map on first use
        self._read_at = -REREAD_S
        if not self.address.cluster:
            client = server_client(self.address, self.options)
            self._shards[self.address.shown] = Shard(self.address.shown, client, self._breaker())
            self._stale_since = None

    def shard_of(self, redis_key: str) -> Shard | None:
        """The shard of ``redis_key``; None while no node answers.

        Raises:
            Refused: the cluster turned this client away (login, ACL, certificate).
        """
        if not self.address.cluster:
            return next(iter(self._shards.values()))
        self._maybe_reread()
        slots = self._slots
        return slots[slot_of(redis_key)] if slots else None

    def peek(self, redis_key: str) -> Shard | None:
        """The shard of ``redis_key`` in the map as it is (never reads it: no I/O)."""
        if not self.address.cluster:
            return next(iter(self._shards.values()))
        slots = self._slots
        return slots[slot_of(redis_key)] if slots else None

    def all(self) -> list[Shard]:
        """Every shard serving slots now (a single server: the one)."""
        if self.address.cluster:
            self._maybe_reread()
            return list({id(s): s for s in self._slots if s is not None}.values())
        return list(self._shards.values())

    def suspect(self) -> None:
        """The map may be stale (a shard failed): read it again soon."""
        if self.address.cluster:
            with self._lock:
                if self._stale_since is None:
                    self._stale_since = self._clock()

    def close(self) -> None:
        with self._lock:
            shards, self._shards = list(self._shards.values()), {}
        for shard in shards:
            shard.redis.close()
            shard.redis.connection_pool.disconnect()

    def _maybe_reread(self) -> None:
        with self._lock:
            now = self._clock()
            if self._stale_since is None or now - self._read_at < REREAD_S:
                return
            self._read_at = now
            self.num_reads += 1
            ranges = self._read()
            if ranges is None:  # no node answered: keep the map, try again a breaker later
                self._read_at = now + self._retry_s - REREAD_S
                return
            slots: list[Shard | None] = [None] * NUM_SLOTS
            for start, end, host, port in ranges:
                shard = self._shard(host, port)
                slots[start : end + 1] = [shard] * (end + 1 - start)
            self._slots, self._stale_since = slots, None

    def _read(self) -> list[tuple[int, int, str, int]] | None:
        """The slot map from the first node that answers: known masters, then seeds."""
        nodes = [(*_host_port(s.name), s) for s in self._shards.values()]
        nodes += [(h, p, None) for h, p in self.address.nodes if f"{h}:{p}" not in self._shards]
        for host, port, shard in nodes:
            if shard is not None and shard.breaker.is_open:
                continue
            client = shard.redis if shard else node_client(self.address, host, port, self.options)
            try:
                ranges = slot_map(client)
            except (redis.RedisError, OSError) as e:
                why = refusal(e)
                if why is not None:
                    raise Refused(why, e) from e
                continue
            finally:
                if shard is None:
                    client.close()
            return [(s, e, h or host, p) for s, e, h, p in ranges]
        return None

    def _shard(self, host: str, port: int) -> Shard:
        name = f"{host}:{port}"
        shard = self._shards.get(name)
        if shard is None:
            client = node_client(self.address, host, port, self.options)
            shard = self._shards[name] = Shard(name, client, self._breaker())
        return shard


def _host_port(name: str) -> tuple[str, int]:
    host, _, port = name.rpartition(":")
    return host, int(port)
