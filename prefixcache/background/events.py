"""KV events: every block stored in or removed from a tier, published on a ZeroMQ socket.

The message layout is vLLM's KV-events layout (``vllm.distributed.kv_events``),
so consumers built for it (Dynamo's KV router, llm-d's indexer, vLLM's example
subscriber) read it: each message is three frames ``[topic, seq, payload]``
(``seq``: 8-byte big-endian batch number from 0), and the payload is a
msgspec-msgpack ``KVEventBatch`` ``[ts, [events...], data_parallel_rank]`` whose
events are tagged arrays::

    ["BlockStored", [hash], parent_hash | None, [token ids], block_size, None, medium]
    ["BlockRemoved", [hash, ...], medium]

``medium`` is the tier: ``hot``, ``ssd`` or ``remote``. A block hash is the
first 8 bytes of the block's 128-bit chain key as an unsigned big-endian int
(``block_hash``); the parent of a chain's first block is None. Only full
blocks are published (a tail, shorter than a block, has no place in the
layout). Events are queued by whichever thread stores or evicts (the caller,
the SSD writer) and sent in that order by one publisher thread that owns the
socket, in batches. The socket is an XPUB: it works as a PUB for subscribers
and tells us when one subscribes (:meth:`EventPublisher.wait_for_subscriber`).
Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..hashing import TOKEN_BYTES
from ..tiers.base import ChainEntry

try:
    import msgspec
    import zmq
except ImportError as err:  # the optional extra is not installed
    raise ImportError(
        f"events_url needs pyzmq and msgspec: pip install 'prefixcache[events]' ({err})"
    ) from None

logger = logging.getLogger(__name__)

_BATCH = 1024  # events per message at most
_MAX_QUEUED = 1 << 20  # events waiting; beyond, new ones are dropped (counted)


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def block_hash(key: bytes) -> int:
    """The published hash of a block key: its first 8 bytes, unsigned big-endian."""
    return int.from_bytes(key[:8], "big")


class EventPublisher:
    """Publishes the blocks the tiers report (a ``BlockListener``) on ``url``.

    Args:
        url: ``tcp://*:5557`` or ``tcp://127.0.0.1:5557`` binds (vLLM's rule: an
            address with ``*``, ``::``, ``ipc://`` or ``inproc://`` binds, any
            other connects).
        block_size: tokens per block (full blocks only are published).
        topic: the first frame of every message.

    Raises:
        ValueError: the socket cannot bind or connect to ``url``.
    """

    def __init__(self, url: str, block_size: int, *, topic: str = "") -> None:
        self.url, self.block_size, self.topic = url, block_size, topic.encode()
        self.num_events = self.num_dropped = self.num_batches = 0
        self.num_subscribers = 0
        self._num_in = 0  # events ever queued
        self._cond = threading.Condition()
        self._queue: deque[BlockStored | BlockRemoved] = deque()
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefixcache-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"events_url {url!r}: {self._error}") from self._error

    # -- BlockListener ---------------------------------------------------------

    def stored(self, tier: str, blocks: Sequence[ChainEntry]) -> None:
        bs = self.block_size
        events = [
            BlockStored(
                [block_hash(b.key)],
                block_hash(b.parent) if b.index else None,
                np.frombuffer(b.tokens, dtype="<u4").tolist(),
                bs,
                None,
                tier,
            )
            for b in blocks
            if len(b.tokens) == TOKEN_BYTES * bs
        ]
        self._put(events)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._put([BlockRemoved([block_hash(k) for k in keys], tier)])

    # -- the publisher ---------------------------------------------------------

    def wait_for_subscriber(self, timeout: float) -> bool:
        """Wait until a subscriber has subscribed (or ``timeout`` seconds passed)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.num_subscribers > 0, timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued so far is sent."""
        with self._cond:
            target = self._num_in
            return self._cond.wait_for(lambda: self.num_events >= target, timeout)

    def close(self) -> None:
        """Send what is queued, then close the socket and stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def stats(self) -> dict[str, int]:
        return {
            "num_events": self.num_events,
            "num_batches": self.num_batches,
            "num_dropped": self.num_dropped,
            "num_subscribers": self.num_subscribers,
        }

    def _put(self, events: list[BlockStored | BlockRemoved]) -> None:
        if not events:
            return
        with self._cond:
            room = _MAX_QUEUED - len(self._queue)
            if room < len(events):
                self.num_dropped += len(events) - max(0, room)
                events = events[: max(0, room)]
            self._queue.extend(events)
            self._num_in += len(events)
            self._cond.notify_all()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.XPUB)
        try:
            sock.set_hwm(100_000)
            binds = any(s in self.url for s in ("*", "::")) or self.url.startswith(
                ("ipc://", "inproc://")
            )
            (sock.bind if binds else sock.connect)(self.url)
        except zmq.ZMQError as err:
            self._error = err
            sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(sock)
        finally:
            sock.close(linger=2000)  # what is sent gets out before the process goes

    def _serve(self, sock: zmq.Socket) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            self._subscriptions(sock)
            with self._cond:
                if not self._queue:
                    if self._stop:
                        return
                    self._cond.wait(0.01)
                    continue
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            payload = encode(KVEventBatch(time.time(), batch))
            sock.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            with self._cond:
                seq += 1
                self.num_batches, self.num_events = seq, self.num_events + len(batch)
                self._cond.notify_all()

    def _subscriptions(self, sock: zmq.Socket) -> None:
        """Count (un)subscriptions the XPUB socket received."""
        while sock.poll(0):
            msg = sock.recv()
            if msg[:1] in (b"\x00", b"\x01"):
                with self._cond:
                    self.num_subscribers += 1 if msg[:1] == b"\x01" else -1
                    self._cond.notify_all()
