"""Remote tier: blocks shared by every host through one Redis / Valkey server.

The tier comes after hot and ssd. It takes every stored block at once
(``eager``): on store, not on spill, so other hosts can restore a prefix
seconds after one host computed it; the write costs the caller nothing (the
byte views are queued, a background writer encodes and sends them). Under
``write_back`` a block would otherwise reach the remote tier only when hot
evicts it, which with a large hot tier is late or never.

``held`` looks a prompt's chain up in one round trip (MGET of the metas);
``reader`` fetches payloads on a background thread (format.py: verified
parts, read straight into the restore buffers); a remote hit is promoted into
hot and ssd by the stack. The server bounds its memory itself (``maxmemory``
with ``allkeys-lru``); an evicted or torn part is a counted miss. When the
server is down or slow every call gives up within the configured timeout and
the breaker (client.py) stops calling for a while: the local tiers keep
serving. The cost gate (gate.py) refuses a remote restore that is expected to
be slower than recomputing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

from ...blocks import Block
from ...config import CacheConfig
from ...errors import MissReason, PayloadError
from ...host import tensors_of
from ..base import Tier, TierReader
from ..writer import WriteItem, Writer
from .client import RemoteClient, RemoteUnavailable
from .format import RemoteMeta, block_meta, decode_meta, encode_parts, meta_key, part_key
from .format import namespace_key as ns_key
from .gate import CostGate

logger = logging.getLogger(__name__)

_KNOWN = 65536  # keys remembered as stored remotely (contains() never asks the server)
_MEMORY_CHECK_S = 1.0  # how often the writer reads the server's memory use (budget)
_COUNTERS = (
    "num_writes", "written_bytes", "num_dropped_writes", "num_no_room", "num_loads",
    "load_bytes", "num_missing_parts", "num_corrupt",
)  # fmt: skip


class RemoteTier(Tier):
    """The shared remote tier of one ``remote_url`` and ``remote_prefix``.

    Args:
        config: ``remote_url``, ``remote_prefix``, the timeouts and breaker
            settings (client.py), ``remote_max_bytes``, ``write_queue_bytes``
            and ``prefill_tokens_per_s`` (gate.py).
        client: an existing connection (e.g. shared with inspection), else one
            is opened from the config.
    """

    name = "remote"
    eager = True

    def __init__(self, config: CacheConfig, *, client: RemoteClient | None = None):
        self.prefix, self.max_bytes = config.remote_prefix, config.remote_max_bytes
        self.client = client if client is not None else RemoteClient(config)
        self.gate = CostGate(config.prefill_tokens_per_s)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._namespaces: dict[bytes, str] = {}  # to write with the next batch
        self._miss: tuple[bytes, MissReason] | None = None
        self._load_miss = MissReason.CORRUPT
        self._last: tuple[Sequence[bytes], int, list[RemoteMeta]] | None = None
        self._memory_checked, self._memory_used = -_MEMORY_CHECK_S, 0
        self._closed = False
        self.writer = Writer(
            self._write_batch,
            max_bytes=config.write_queue_bytes,
            housekeeping=self._write_namespaces,
            batch_bytes=16 << 20,
            name="prefixcache-remote-writer",
        )

    @property
    def load_miss(self) -> MissReason:  # type: ignore[override]
        """Why the last block the reader could not load was unusable."""
        return self._load_miss

    # -- read path -------------------------------------------------------------

    def held(self, keys: Sequence[bytes], start: int) -> list[RemoteMeta]:
        self._miss = None
        metas = self._lookup(keys, start)
        tokens = sum(len(m.tokens) for m in metas) // 4
        if metas and not self.gate.admits(sum(m.nbytes for m in metas), tokens):
            self._miss = (keys[start], MissReason.REMOTE_GATE)
            return []
        return metas

    def entry(self, key: bytes) -> RemoteMeta | None:
        """Block ``key``'s meta (one round trip; ``held`` batches a chain in one)."""
        try:
            raw = self.client.call(lambda r: r.get(meta_key(self.prefix, key)))
        except RemoteUnavailable:
            return None
        try:
            return None if raw is None else decode_meta(key, raw)
        except PayloadError as e:
            self._corrupt(key, e)
            return None

    def miss_reason(self, key: bytes) -> MissReason | None:
        miss = self._miss
        return miss[1] if miss is not None and miss[0] == key else None

    def meta_of(self, keys: Sequence[bytes], index: int) -> RemoteMeta | None:
        """Block ``index``'s meta from the last lookup of ``keys`` (no round trip)."""
        last = self._last
        if last is None or last[0] is not keys or not 0 <= index - last[1] < len(last[2]):
            return None
        return last[2][index - last[1]]

    def contains(self, key: bytes) -> bool:
        """Queued or known to be stored (asks no server: the caller must not wait)."""
        with self._lock:
            known = key in self._known
        return known or self.writer.pending(key) is not None

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        from .reader import RemoteReader

        return RemoteReader(self, keys)

    def load_failed(self, key: bytes, reason: MissReason, error: BaseException | None) -> None:
        """Count a block the reader could not use (on the caller's thread)."""
        self._load_miss = reason
        if reason is MissReason.EVICTED:
            self._count("num_missing_parts")
        elif reason is MissReason.CORRUPT:
            self._corrupt(key, error)

    def loaded(self, nbytes: int, seconds: float) -> None:
        """Count a block fetched in ``seconds`` (the gate's remote rate)."""
        self._count("num_loads")
        self._count("load_bytes", nbytes)
        self.gate.remote.add(nbytes, seconds)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        self.gate.prefill.add(num_tokens, seconds)

    # -- write path ------------------------------------------------------------

    def put(self, block: Block) -> bool:
        """Queue a block (arrays evaluated) for the writer; False if it was dropped."""
        if self._closed:
            raise RuntimeError(f"remote tier {self.client.url} is closed")
        if self.contains(block.key):
            return True
        if not self.client.breaker.allow():  # down: queueing would only delay the drop
            self._count("num_dropped_writes")
            return False
        nbytes = block.nbytes or sum(a.nbytes for a in block.arrays.values())
        if self.writer.submit(WriteItem(block, tensors_of(block.arrays), nbytes)):
            return True
        self._count("num_dropped_writes")
        return False

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget blocks locally. The server keeps them until a new version is put
        (a write replaces every key of a block) or its LRU evicts them."""
        with self._lock:
            return sum(self._known.pop(k, False) is None for k in keys)

    def note_namespace(self, root: bytes, namespace_json: str) -> None:
        with self._lock:
            self._namespaces[root] = namespace_json
        self.writer.wake()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.writer.close()
        finally:
            self.client.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        return {
            **self.client.counts(),
            "queue_depth": self.writer.queue_depth,
            "queue_bytes": self.writer.queue_bytes,
            "num_write_failures": self.writer.num_failures,
            **{name: counts.get(name, 0) for name in _COUNTERS},
            **self.gate.stats(),
        }

    # -- internals -------------------------------------------------------------

    def _lookup(self, keys: Sequence[bytes], start: int) -> list[RemoteMeta]:
        """Metas of ``keys[start:]`` while consecutive: one MGET per prompt."""
        last = self._last
        if last is not None and last[0] is keys and last[1] <= start:
            return last[2][start - last[1] :]
        todo = [meta_key(self.prefix, k) for k in keys[start:]]
        if not todo:
            return []
        try:
            raws = self.client.call(lambda r: r.mget(todo))
        except RemoteUnavailable:
            self._miss = (keys[start], MissReason.REMOTE_UNAVAILABLE)
            return []
        metas: list[RemoteMeta] = []
        for key, raw in zip(keys[start:], raws, strict=True):
            if raw is None:
                break
            try:
                metas.append(decode_meta(key, raw))
            except PayloadError as e:
                self._corrupt(key, e)
                break
        self._last = (keys, start, metas)
        return metas

    def _write_batch(self, items: list[WriteItem]) -> None:
        """Encode and send a batch: each block's parts, then its meta (writer thread)."""
        if not self.client.breaker.allow():  # down: drop without encoding
            self._count("num_dropped_writes", len(items))
            return
        if not self._room(sum(it.nbytes for it in items)):
            self._count("num_no_room", len(items))
            self._count("num_dropped_writes", len(items))
            return
        sent = []
        try:
            with self.client.redis.pipeline(transaction=False) as pipe:
                for item in items:
                    parts, sums = encode_parts(item.block.key, item.tensors)
                    for n, part in enumerate(parts):
                        pipe.set(part_key(self.prefix, item.block.key, n), part)
                    meta = block_meta(item.block, item.tensors, sums)
                    pipe.set(meta_key(self.prefix, item.block.key), meta)  # after its parts
                    sent.append(item)
                self.client.call(lambda _: pipe.execute())
        except RemoteUnavailable:
            self._count("num_dropped_writes", len(items))
            return
        with self._lock:
            for item in sent:
                self._known[item.block.key] = None
            while len(self._known) > _KNOWN:
                self._known.popitem(last=False)
            self._counts["num_writes"] += len(sent)
            self._counts["written_bytes"] += sum(it.nbytes for it in sent)

    def _room(self, nbytes: int) -> bool:
        """Under ``remote_max_bytes``: the server's memory use (read at most once a
        second) leaves room for ``nbytes`` more."""
        if not self.max_bytes:
            return True
        now = time.monotonic()
        if now - self._memory_checked >= _MEMORY_CHECK_S:
            try:
                info = self.client.call(lambda r: r.info("memory"))
            except RemoteUnavailable:
                return False
            self._memory_checked, self._memory_used = now, int(info["used_memory"])
        if self._memory_used + nbytes > self.max_bytes:
            return False
        self._memory_used += nbytes
        return True

    def _write_namespaces(self) -> None:
        with self._lock:
            notes, self._namespaces = self._namespaces, {}
        if not notes:
            return
        try:
            values = {ns_key(self.prefix, root): doc for root, doc in notes.items()}
            self.client.call(lambda r: r.mset(values))
        except RemoteUnavailable:
            with self._lock:  # try again with a later batch
                self._namespaces = notes | self._namespaces

    def _count(self, name: str, num: int = 1) -> None:
        with self._lock:
            self._counts[name] += num

    def _corrupt(self, key: bytes, error: BaseException | None) -> None:
        with self._lock:
            self._counts["num_corrupt"] += 1
            first = self._counts["num_corrupt"] == 1
        log = logger.warning if first else logger.debug
        log("remote tier: unusable block %s (%s): a miss", key.hex(), error)
