"""KV events: every block stored in or removed from a tier, published on a ZeroMQ socket.

Each message is three frames ``[topic, seq, payload]`` (``seq``: 8-byte
big-endian batch number from 0) whose payload is a batch in vLLM's current
layout (kv_events.py: Dynamo's KV router, llm-d's indexer and radixview read
it as it is) or, with ``form="sglang"``, SGLang's own (sglang_events.py). A block is published
once per cache group of the layout (``groups``: e.g. a sliding window and full
attention) with the tier's medium and locality; ``extra_keys`` carries, on a
chain's first block only, the values of the namespace's extra keys
(``cache_salt``) that went into its hash, as vLLM does. The parent of a
chain's first block is None. Only full blocks are published (a tail, shorter
than a block, has no place in the layout). A publisher's first batch starts
with ``AllBlocksCleared``: a consumer that kept what an earlier process
published (a restarted server) drops it, since that process's hot tier is
gone; blocks are announced as tiers store them.

Events are queued by whichever thread stores or evicts (the caller, the SSD
writer) and sent in that order by one publisher thread that owns the socket,
in batches. The socket is an XPUB: it works as a PUB for subscribers and
tells us when one subscribes (:meth:`EventPublisher.wait_for_subscriber`).
Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..hashing import TOKEN_BYTES
from ..tiers.base import ChainEntry

try:
    import msgspec
    import zmq

    from .kv_events import FULL_ATTENTION, Extra, VllmForm, block_hash
    from .sglang_events import SglangForm
except ImportError as err:  # the optional extra is not installed
    raise ImportError(
        f"events_url needs pyzmq and msgspec: pip install 'prefixcache[events]' ({err})"
    ) from None

logger = logging.getLogger(__name__)

_BATCH = 1024  # events per message at most
_MAX_QUEUED = 1 << 20  # events waiting; beyond, new ones are dropped (counted)


class EventPublisher:
    """Publishes the blocks the tiers report (a ``BlockListener``) on ``url``.

    Args:
        url: ``tcp://*:5557`` or ``tcp://127.0.0.1:5557`` binds (vLLM's rule: an
            address with ``*``, ``::``, ``ipc://`` or ``inproc://`` binds, any
            other connects).
        block_size: tokens per block (full blocks only are published).
        topic: the first frame of every message.
        groups: the layout's cache groups, ``(kv_cache_spec_kind, sliding window)``
            each; a block is published once per group (``group_idx``).
        form: ``"vllm"`` (kv_events.py) or ``"sglang"`` (sglang_events.py).

    Raises:
        ValueError: the socket cannot bind or connect to ``url``.
    """

    def __init__(
        self,
        url: str,
        block_size: int,
        *,
        topic: str = "",
        groups: Sequence[tuple[str, int | None]] = (FULL_ATTENTION,),
        form: str = "vllm",
    ) -> None:
        self.url, self.block_size, self.topic = url, block_size, topic.encode()
        self.form = SglangForm(block_size) if form == "sglang" else VllmForm(block_size, groups)
        self._extra: dict[bytes, Extra] = {}  # root -> its extra keys
        self.num_events = self.num_dropped = self.num_batches = 0
        self.num_subscribers = 0
        self._num_in = 0  # events ever queued
        self._cond = threading.Condition()
        self._queue: deque[Any] = deque()
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
        events: list[Any] = []
        for b in blocks:
            if len(b.tokens) != TOKEN_BYTES * self.block_size:
                continue
            first = b.index == 0
            extra = self._extra.get(b.root, ()) if first else ()
            parent = None if first else block_hash(b.parent)
            tokens = np.frombuffer(b.tokens, dtype="<u4").tolist()
            events += self.form.stored(tier, block_hash(b.key), parent, tokens, extra)
        self._put(events)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._put(self.form.removed(tier, [block_hash(k) for k in keys]))

    def note_namespace(self, root: bytes, extra: Sequence[tuple[str, str]]) -> None:
        """Tell the extra keys (``cache_salt``...) of the namespace under ``root``:
        published with its chains' first blocks."""
        if extra:
            self._extra[root] = tuple(sorted(extra))

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

    def _put(self, events: list[Any]) -> None:
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
            if seq == 0:  # what an earlier process published is void: its hot tier is gone
                batch.insert(0, self.form.cleared())
            payload = encode(self.form.batch(time.time(), batch))
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
