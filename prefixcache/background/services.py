"""The background services of one PrefixCache: the counters saver, the warm start, KV events.

Each runs on a thread of its own, started when the cache opens if its setting
asks for it: ``counters_save_seconds`` (the counters since the last save are
added to the lower tiers' record of the model, so a killed process loses at
most that much of them), ``warm_bytes`` (pinned and recently used chains
loaded into hot after a restart) and ``events_url`` (every block stored or
removed published; the ``events`` extra). The saver and the warm start run
only with a lower tier. ``stop`` ends the threads that take the cache's lock
(called before the cache flushes under it); ``close`` ends the events
publisher last, once the final flush's events are queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..config import CacheConfig
from ..stats import Stats, counter_delta
from ..tiers.governor import watch
from ..tiers.stack import TierStack
from .periodic import Periodic
from .warm import CacheLock, WarmStart

if TYPE_CHECKING:
    from .events import EventPublisher


class Services:
    """The background services of one cache.

    Args:
        config: the cache's settings.
        tiers: its tiers (the events publisher watches them; warm start fills hot).
        lock: its lock.
        stats: its counters.
        root: its base namespace's root key (where counters are recorded).
        groups: its layout's cache groups (named in KV events).
    """

    def __init__(
        self,
        config: CacheConfig,
        tiers: TierStack,
        lock: CacheLock,
        stats: Stats,
        root: Callable[[], bytes],
        groups: Sequence[tuple[str, int | None]] = (),
    ) -> None:
        self.tiers, self.lock, self.counters, self.root = tiers, lock, stats, root
        self._saved: dict[str, object] = stats.as_dict()  # counters as last saved
        self.events: EventPublisher | None = None
        if config.events_url is not None:
            from .events import EventPublisher  # pyzmq and msgspec only when asked for

            self.events = EventPublisher(
                config.events_url, config.block_size, groups=groups, form=config.events_format
            )
            watch(tiers.all, tiers.governor, self.events)
        seconds = config.counters_save_seconds
        self.saver = (  # a killed process loses at most `seconds` of counters
            Periodic(seconds, self._save_now, "prefixcache-counters")
            if seconds > 0 and tiers.lower
            else None
        )
        self.warm = (
            WarmStart(tiers, lock, config.warm_bytes)
            if config.warm_bytes > 0 and tiers.lower
            else None
        )

    def stop(self) -> None:
        """Stop the threads that take the cache's lock (not under the lock)."""
        saver, self.saver = self.saver, None
        if saver is not None:
            saver.stop()  # its last call may be waiting for the lock
        if self.warm is not None:
            self.warm.stop()

    def close(self) -> None:
        """Send the queued events and stop the publisher."""
        if self.events is not None:
            self.events.close()

    def note_namespace(self, root: bytes, extra: Sequence[tuple[str, str]]) -> None:
        """A namespace with extra keys (``cache_salt``...): its values go into the events."""
        if self.events is not None:
            self.events.note_namespace(root, extra)

    def save_counters(self) -> None:
        """Add the counters since the last save to the lower tiers' record of this model
        (under the cache's lock)."""
        now = self.counters.as_dict()
        if self.tiers.hot.tenants is not None:  # per tenant, for `prefixcache stats`
            now["tenants"] = self.tiers.hot.tenants.counters()
        self.tiers.save_counters(self.root(), counter_delta(now, self._saved))
        self._saved = now

    def _save_now(self) -> None:
        with self.lock:
            if self.saver is not None:  # not stopped meanwhile
                self.save_counters()

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.warm is not None:
            out["warm"] = self.warm.stats()
        if self.events is not None:
            out["events"] = self.events.stats()
        return out
