"""The remote tier's connections: one server or a cluster's shards, each behind its
own timeouts, counted failures and circuit breaker.

Every call goes to one shard through :meth:`RemoteClient.call`: it gives up
after the configured connect/operation timeout (redis-py's socket timeouts,
no retries), counts the failure, and after ``remote_breaker_failures``
consecutive failures opens that shard's breaker: for ``remote_breaker_ms``
every call to it fails at once without touching the network. After that one
call is let through; its success closes the breaker, its failure opens it
again. A shard that is down is a miss for its keys only; the others keep
serving. Reconnecting is redis-py's: a broken connection is dropped and the
next call opens a new one. :meth:`RemoteClient.each` sends one job per shard
in parallel (a chain lookup: one round trip per shard involved).

A refused login (wrong password, unknown user), a user without the rights
the cache needs (ACL ``NOPERM``) or a server certificate that does not verify
is not an outage: it is logged once as an error that says so (the URL with its
password redacted) and turns the remote tier off for this process (a
local-only cache); fix the setting and restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import redis

from ...config import CacheConfig
from .shards import Refused, Shard, ShardMap, refusal

logger = logging.getLogger(__name__)

T = TypeVar("T")
_FAILS = (redis.ConnectionError, redis.TimeoutError, TimeoutError, OSError)
_STALE_MAP = (
    redis.exceptions.AskError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)  # MOVED is an AskError


class RemoteUnavailable(Exception):
    """A remote call failed, timed out, or was skipped (open breaker, tier off)."""


class RemoteClient:
    """Calls to a Redis / Valkey server or cluster (thread-safe).

    Args:
        config: ``remote_url``, ``remote_connect_timeout_ms``,
            ``remote_timeout_ms``, ``remote_breaker_failures``,
            ``remote_breaker_ms`` and the ``remote_tls_*`` files.
        clock: the breakers' clock (monotonic seconds).
    """

    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic):
        if config.remote_url is None:
            raise ValueError("remote_url is None: no remote server to connect to")
        self.shards = ShardMap(config, clock)
        self.url = self.shards.address.shown  # the password redacted: safe to log
        self.off: str | None = None  # why the tier was turned off (a setting is wrong)
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def cluster(self) -> bool:
        return self.shards.address.cluster

    def shard_of(self, redis_key: str) -> Shard | None:
        """The shard serving ``redis_key``; None when none can be found now."""
        if self.off is not None:
            return None
        try:
            return self.shards.shard_of(redis_key)
        except Refused as e:
            self._turn_off(e.why, e.error)
            return None

    def call(self, shard: Shard | None, fn: Callable[[redis.Redis], T]) -> T:
        """``fn(shard's client)``, or RemoteUnavailable when it cannot answer now.

        Raises:
            RemoteUnavailable: the tier is off, the breaker is open, or the call
                failed or timed out.
        """
        if shard is None or self.off is not None or not shard.breaker.allow():
            self._count("num_skipped")
            if shard is not None:
                self.shards.suspect()
            raise RemoteUnavailable(self.off or "remote shard unknown or its breaker is open")
        try:
            out = fn(shard.redis)
        except (redis.RedisError, OSError) as e:
            why = refusal(e)
            if why is not None:
                raise self._turn_off(why, e) from e
            raise self._unavailable(shard, e) from e
        shard.breaker.succeeded()
        return out

    def _unavailable(self, shard: Shard, error: BaseException) -> RemoteUnavailable:
        """Count a failed call to ``shard``; the error its caller raises."""
        if isinstance(error, _FAILS):
            self._failed(shard, "num_timeouts" if _timeout(error) else "num_errors", error)
        elif isinstance(error, _STALE_MAP):
            self._count("num_moved")  # the slot map is stale: read again before the next call
            self.shards.suspect()
        elif isinstance(error, redis.ResponseError):  # e.g. OOM under noeviction: no breaker
            self._count("num_errors")
            logger.debug("remote tier %s (%s): %s", self.url, shard.name, error)
        else:  # a protocol error: as broken as a lost connection
            self._failed(shard, "num_errors", error)
        return RemoteUnavailable(str(error))

    def each(
        self, jobs: Sequence[tuple[Shard | None, Callable[[redis.Redis], T]]]
    ) -> list[T | RemoteUnavailable]:
        """Run one call per shard, in parallel when there are several: each job's
        result, or the RemoteUnavailable it raised."""

        def run(job: tuple[Shard | None, Callable[[redis.Redis], T]]) -> T | RemoteUnavailable:
            try:
                return self.call(*job)
            except RemoteUnavailable as e:
                return e

        if len(jobs) <= 1:
            return [run(job) for job in jobs]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(16, thread_name_prefix="prefixcache-remote-shard")
            pool = self._pool
        return list(pool.map(run, jobs))

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        shards = self.shards.all()
        names = ("num_errors", "num_timeouts", "num_skipped", "num_moved")
        return {
            "breaker_open": int(any(s.breaker.is_open for s in shards)),
            "num_breaker_trips": sum(s.breaker.num_trips for s in shards),
            "num_shards": len(shards),
            "num_shards_down": sum(s.breaker.is_open for s in shards),
            "num_slot_map_reads": self.shards.num_reads,
            "off": int(self.off is not None),
            **{n: counts.get(n, 0) for n in names},
        }

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.shards.close()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _failed(self, shard: Shard, name: str, error: BaseException) -> None:
        self._count(name)
        self.shards.suspect()
        if shard.breaker.failed():
            logger.warning(
                "remote tier %s unreachable (%s): not calling it for %.1f s",
                self.url if shard.name == self.url else f"{self.url}: shard {shard.name}",
                error,
                shard.breaker.open_seconds,
            )

    def _turn_off(self, why: str, error: BaseException) -> RemoteUnavailable:
        """Turn the tier off for good (a setting is wrong); log it once."""
        self._count("num_errors")
        with self._lock:
            first, self.off = self.off is None, self.off or why
        if first:
            logger.error(
                "remote tier %s: %s (%s): remote tier off, this cache is local-only until "
                "the setting is fixed and the process restarted",
                self.url,
                why,
                error,
            )
        return RemoteUnavailable(why)


def _timeout(error: BaseException) -> bool:
    return isinstance(error, (redis.TimeoutError, TimeoutError))
