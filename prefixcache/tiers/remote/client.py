"""The remote tier's connection: a redis-py client with timeouts, counted failures
and a circuit breaker.

Every call goes through :meth:`RemoteClient.call`: it gives up after the
configured connect/operation timeout (redis-py's socket timeouts, no retries),
counts the failure, and after ``remote_breaker_failures`` consecutive failures
opens the breaker: for ``remote_breaker_ms`` every call fails at once without
touching the network. After that one call is let through; its success closes
the breaker, its failure opens it again. Reconnecting is redis-py's: a broken
connection is dropped and the next call opens a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...config import CacheConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RemoteUnavailable(Exception):
    """A remote call failed, timed out, or was skipped by the open breaker."""


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


class RemoteClient:
    """A Redis / Valkey connection pool behind a breaker (thread-safe).

    Args:
        config: ``remote_url``, ``remote_connect_timeout_ms``,
            ``remote_timeout_ms``, ``remote_breaker_failures``, ``remote_breaker_ms``.
        clock: the breaker's clock (monotonic seconds).
    """

    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic):
        if config.remote_url is None:
            raise ValueError("remote_url is None: no remote server to connect to")
        self.url = config.remote_url
        self.redis = redis.Redis.from_url(
            config.remote_url,
            socket_timeout=config.remote_timeout_ms / 1000,
            socket_connect_timeout=config.remote_connect_timeout_ms / 1000,
            retry=Retry(NoBackoff(), 0),  # one attempt: the breaker decides when to try again
            health_check_interval=0,
        )
        self.breaker = Breaker(
            config.remote_breaker_failures, config.remote_breaker_ms / 1000, clock
        )
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """``fn(client)``, or RemoteUnavailable when the server cannot answer now.

        Raises:
            RemoteUnavailable: the breaker is open, or the call failed or timed out.
        """
        if not self.breaker.allow():
            self._count("num_skipped")
            raise RemoteUnavailable("remote tier breaker is open")
        try:
            out = fn(self.redis)
        except (redis.TimeoutError, TimeoutError) as e:
            self._failed("num_timeouts", e)
            raise RemoteUnavailable(str(e)) from e
        except (redis.ConnectionError, OSError) as e:
            self._failed("num_errors", e)
            raise RemoteUnavailable(str(e)) from e
        except redis.ResponseError as e:  # e.g. OOM under maxmemory noeviction: no breaker
            self._count("num_errors")
            logger.debug("remote tier %s: %s", self.url, e)
            raise RemoteUnavailable(str(e)) from e
        except redis.RedisError as e:  # a protocol error: as broken as a lost connection
            self._failed("num_errors", e)
            raise RemoteUnavailable(str(e)) from e
        self.breaker.succeeded()
        return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        return {
            "breaker_open": int(self.breaker.is_open),
            "num_breaker_trips": self.breaker.num_trips,
            **{n: counts.get(n, 0) for n in ("num_errors", "num_timeouts", "num_skipped")},
        }

    def close(self) -> None:
        self.redis.close()
        self.redis.connection_pool.disconnect()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _failed(self, name: str, error: BaseException) -> None:
        self._count(name)
        if self.breaker.failed():
            logger.warning(
                "remote tier %s unreachable (%s): not calling it for %.1f s",
                self.url,
                error,
                self.breaker.open_seconds,
            )
