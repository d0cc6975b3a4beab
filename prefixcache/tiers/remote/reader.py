"""Remote reads for a restore: a background thread fetches blocks in chain order.

Each block is one round trip to its shard (pipelined GETs of its parts, and of
its tenant when it has one, which share its hash tag; its meta came with the
chain's lookup). Their replies are
read off the socket straight into the tensors' places in the restore buffers
and verified as they arrive (one copy, hashed while in the CPU cache; with a
secret, MAC'd in a staging buffer first), all on the fetch thread with bytes
and numpy only; the caller gets ``Placed`` tensors, and HostArrays for tensors
with no place (a builder copies those in, or turns them into MLX arrays on
its own thread). The thread fetches at most ``AHEAD`` blocks beyond the one
the caller takes, so a long chain is never all in memory at once. It stops at
the first block it cannot use: the restore stops there too (a block that
fails may have written some of its bytes into the buffers: they are never
exposed).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ...errors import MissReason, PayloadError
from ...memory.host import MX_DTYPES, Place, Placed, StreamedBlock
from ..base import TierReader
from .client import RemoteUnavailable
from .fill import Targets, receive, targets
from .format import RemoteMeta, decode_meta
from .names import Names
from .reads import RemoteReads
from .tenant import read_tenant
from .wire import Replies, pipelined_gets

AHEAD = 2


@dataclass(frozen=True, slots=True)
class Fetched:
    block: StreamedBlock
    seconds: float  # the block's round trip


@dataclass(frozen=True, slots=True)
class Failed:
    key: bytes
    reason: MissReason
    error: BaseException | None


class RemoteReader(TierReader):
    """The blocks of one restore that the remote tier holds, fetched in chain order."""

    def __init__(self, tier: RemoteReads, keys: Sequence[bytes]):
        self.tier, self.keys = tier, keys
        self._order: list[int] = []
        self._next = 0
        self._place: Place | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._results: queue.Queue[Fetched | Failed | Exception] = queue.Queue(AHEAD)
        self._missed: dict[int, MissReason] = {}

    def first_shapes(self, indices: list[int]) -> Mapping[str, Placed] | None:
        """Block ``indices[0]``'s tensors from its meta (checksummed, fetched with
        the chain), so the restore buffers exist before the first copy."""
        meta = self.tier.meta_of(self.keys, indices[0]) if indices else None
        if meta is None:
            return None
        return {name: Placed(None, MX_DTYPES[dtype], shape) for name, dtype, shape in meta.specs}

    def prepare(self, indices: list[int], place: Place | None) -> None:
        self.close()
        self._order, self._next, self._place = list(indices), 0, place
        if indices:
            self._stop = threading.Event()
            self._results = queue.Queue(AHEAD)
            self._thread = threading.Thread(
                target=self._run,
                args=(self._stop, self._results),
                daemon=True,
                name="prefixcache-remote-read",
            )
            self._thread.start()

    def load(self, index: int) -> StreamedBlock | None:
        if self._thread is None or self._order[self._next : self._next + 1] != [index]:
            return self._use(index, self._fetch(index))  # unplanned: one synchronous fetch
        self._next += 1
        return self._use(index, self._take(index))

    def miss(self, index: int) -> MissReason:
        """Why block ``index`` was unusable: parts missing (evicted) or damaged."""
        return self._missed.get(index, MissReason.CORRUPT)

    def close(self) -> None:
        """Stop the fetch thread and wait for it; safe to call more than once."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._place = None  # it reaches the restore buffers: hold nothing once closed

    def _take(self, index: int) -> Fetched | Failed | Exception:
        """The fetch thread's next result; if the thread stopped before it (after a
        block the caller went past), a synchronous fetch."""
        while True:
            try:
                return self._results.get(timeout=0.05)
            except queue.Empty:
                thread = self._thread
                if (thread is None or not thread.is_alive()) and self._results.empty():
                    return self._fetch(index)

    def _run(
        self, stop: threading.Event, results: queue.Queue[Fetched | Failed | Exception]
    ) -> None:
        for index in self._order:
            if stop.is_set():
                return
            try:
                result: Fetched | Failed | Exception = self._fetch(index)
            except Exception as e:  # a bug: hand it to the caller instead of hanging it
                result = e
            while not stop.is_set():
                try:
                    results.put(result, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if not isinstance(result, Fetched):
                return

    def _fetch(self, index: int) -> Fetched | Failed:
        """Fetch and verify block ``index`` (bytes and numpy only: any thread)."""
        key, tier, names = self.keys[index], self.tier, self.tier.names
        client = tier.client
        start = time.perf_counter()
        try:
            shard = client.shard_of(names.meta(key))  # the block's meta and parts: one shard
            meta = tier.meta_of(self.keys, index)
            if meta is None:
                raw = client.call(shard, lambda r: r.get(names.meta(key)))
                if raw is None:
                    return Failed(key, MissReason.EVICTED, None)
                meta = decode_meta(names.name(key), raw, names, key)
            gets = [names.tenant(key)] if meta.has_tenant else []
            gets += [names.part(key, n) for n in range(meta.num_parts)]
            into = targets(meta, self._place)
            tenant: list[str] = []
            body = _receive_all(into, meta, names, tenant)
            if not client.call(shard, lambda r: pipelined_gets(r, gets, body)):
                return Failed(key, MissReason.EVICTED, None)  # evicted, or a torn write
        except RemoteUnavailable as e:
            return Failed(key, MissReason.REMOTE_UNAVAILABLE, e)
        except PayloadError as e:  # Forged too: counted apart by the tier
            return Failed(key, MissReason.CORRUPT, e)
        seconds = time.perf_counter() - start
        b = meta
        block = StreamedBlock(
            key, b.parent, b.root, b.index, b.tokens, into.arrays, b.nbytes, tenant[0]
        )
        return Fetched(block, seconds)

    def _use(self, index: int, result: Fetched | Failed | Exception) -> StreamedBlock | None:
        """Count the result on the caller's thread; None for a miss."""
        if isinstance(result, Exception):
            raise RuntimeError("remote tier reader failed") from result
        if isinstance(result, Failed):
            self._missed[index] = result.reason
            self.tier.load_failed(result.key, result.reason, result.error)
            return None
        self.tier.loaded(result.block, result.seconds)
        return result.block


def _receive_all(
    into: Targets, meta: RemoteMeta, names: Names, tenant: list[str]
) -> Callable[[Replies], bool]:
    """Read the block's tenant (into ``tenant``: its key's, if its meta says it has
    one), then every part of ``meta`` into ``into``; False at the first missing part."""

    def body(replies: Replies) -> bool:
        tenant.append(read_tenant(replies, meta.key, names) if meta.has_tenant else "")
        return all(receive(into, meta, names, n, replies) for n in range(meta.num_parts))

    return body
