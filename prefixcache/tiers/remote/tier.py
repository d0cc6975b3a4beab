"""Remote tier: blocks shared by every host through a Redis / Valkey server or cluster.

The tier comes after hot and ssd. It takes every stored block at once
(``eager``): on store, not on spill (under ``write_back`` a block would reach
it late or never), so other hosts can restore a prefix seconds after one host
computed it; the caller only queues byte views, and a background writer
encodes and sends them in batches. Tails go remote too (``ListsChildren``: a
parent's children are listed in a set beside it), so a conversation resumes
on another host to the exact token.

``held`` looks a prompt's chain up in one round trip per shard (the metas);
``children`` reads only the listed children nearest to the prompt (listing.py),
so neither grows with what the server holds; ``reader`` fetches payloads on a background thread
(verified parts, read straight into the restore buffers); a remote hit is
promoted into hot and ssd by the stack. The server bounds its memory itself
(``maxmemory`` with ``allkeys-lru``), unless tenant shares are set
(``remote_tenant_floors`` / ``_caps``): then the writers evict by the tenants'
floors and caps within ``remote_max_bytes`` (shares.py). An evicted or torn part is a counted
miss, a value that fails its MAC (``remote_secret``) a counted forgery. When a
server is down or slow every call to it gives up within the configured
timeout and its circuit breaker stops calling it for a while: the local tiers
and the other shards keep serving. The cost gate (``CostGated``) refuses a
remote restore expected to be slower than recomputing.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

from ...blocks import Block
from ...config import CacheConfig
from ...errors import MissReason, PayloadError
from ...hashing import TOKEN_BYTES
from ...memory.host import tensors_of
from ..base import CostGated, ListsChildren, Persistent, SharesTenants, Tier, TierReader
from ..run_length import NO_HINTS, RunHints
from ..writer import WriteItem, Writer
from .chain import children_of, look_up
from .client import RemoteClient, RemoteUnavailable
from .format import RemoteMeta, decode_meta
from .gate import CostGate
from .known import Known
from .names import REPORTED, Names
from .reads import RemoteReads
from .seal import Seal, load_secret
from .shares import remote_shares
from .writes import RemoteWrites

logger = logging.getLogger(__name__)

_COUNTERS = (
    "num_writes",
    "written_bytes",
    "num_dropped_writes",
    "num_no_room",
    "num_loads",
    "load_bytes",
    "num_missing_parts",
    "num_corrupt",
    "num_forged",
    "num_removed",
)


class RemoteTier(ListsChildren, Persistent, CostGated, SharesTenants, Tier):
    """The shared remote tier of one ``remote_url`` and ``remote_prefix``.

    Args:
        config: ``remote_url``, ``remote_prefix``, the timeouts and breaker
            settings (client.py), ``remote_secret`` (seal.py),
            ``remote_max_bytes``, ``write_queue_bytes`` and
            ``prefill_tokens_per_s`` (gate.py).
        client: an existing connection (e.g. shared with inspection), else one
            is opened from the config.
    """

    name = "remote"
    eager = True

    def __init__(self, config: CacheConfig, *, client: RemoteClient | None = None):
        secret = load_secret(config)
        self.names = Names(config.remote_prefix, Seal(secret) if secret else None)
        self.prefix = config.remote_prefix
        self.block_bytes = config.block_size * TOKEN_BYTES  # the longest child's tokens
        self.client = client if client is not None else RemoteClient(config)
        self.shares = remote_shares(config, self.client)
        self.writes = RemoteWrites(self.client, self.names, config.remote_max_bytes, self.shares)
        self.gate = CostGate(config.prefill_tokens_per_s)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._known = Known(self.names.name if self.shares is not None else None)
        self._namespaces: dict[bytes, str] = {}  # to write with the next batch
        self._removals: dict[bytes, None] = {}  # to delete on the server, in order
        self._miss: tuple[bytes, MissReason] | None = None
        self.reads = RemoteReads(self.names, self.client, self.gate, self._counts, self._lock)
        if self.shares is not None:
            self.reads.used = {}
        self._closed = False
        self.writer = Writer(
            self._write_batch,
            max_bytes=config.write_queue_limit,
            housekeeping=self._housekeeping,
            batch_bytes=16 << 20,
            name="prefixcache-remote-writer",
        )

    # -- read path -------------------------------------------------------------

    def held(self, keys: Sequence[bytes], start: int) -> list[RemoteMeta]:
        self._miss = None
        metas = self._lookup(keys, start)
        tokens = sum(len(m.tokens) for m in metas) // TOKEN_BYTES
        if metas and not self.gate.admits(sum(m.nbytes for m in metas), tokens):
            self._miss = (keys[start], MissReason.REMOTE_GATE)
            return []
        return metas

    def entry(self, key: bytes) -> RemoteMeta | None:
        """Block ``key``'s meta (one round trip; ``held`` batches a chain)."""
        name = self.names.meta(key)
        try:
            raw = self.client.call(self.client.shard_of(name), lambda r: r.get(name))
        except RemoteUnavailable:
            return None
        try:
            return None if raw is None else decode_meta(self.names.name(key), raw, self.names, key)
        except PayloadError as e:
            self.reads.unusable(key, e)
            return None

    def children(self, parent: bytes, near: bytes | None = None) -> list[RemoteMeta]:
        """Blocks and tails stored under ``parent``; with ``near``, the few nearest
        to it (one round trip for their names, one per shard for the metas the
        last lookup did not bring)."""
        miss = self._miss
        if miss is not None and miss[1] is MissReason.REMOTE_GATE:  # refused for this prompt
            return []
        at = near[: self.block_bytes] if near is not None else None
        return children_of(
            self.client, self.names, parent, self.reads.last, self.reads.unusable, at
        )

    def miss_reason(self, key: bytes) -> MissReason | None:
        miss = self._miss
        return miss[1] if miss is not None and miss[0] == key else None

    def contains(self, key: bytes) -> bool:
        """Queued or known to be stored (asks no server: the caller must not wait)."""
        with self._lock:
            known = key in self._known
        return known or self.writer.pending(key) is not None

    def reader(self, keys: Sequence[bytes]) -> TierReader:
        from .reader import RemoteReader

        return RemoteReader(self.reads, keys)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        self.gate.prefill.add(num_tokens, seconds)

    # -- write path ------------------------------------------------------------

    def put(self, block: Block) -> bool:
        """Queue a block (arrays evaluated) for the writer; False if it was dropped."""
        if self._closed:
            raise RuntimeError(f"remote tier {self.client.url} is closed")
        with self._lock:
            self._removals.pop(block.key, None)  # a new version replaces the removed one
        if self.contains(block.key):
            return True
        shard = self.client.shards.peek(self.names.meta(block.key))  # no I/O: the caller's thread
        if self.client.off is not None or (shard is not None and not shard.breaker.allow()):
            self.reads.count("num_dropped_writes")  # down: queueing would only delay the drop
            return False
        nbytes = block.nbytes or sum(a.nbytes for a in block.arrays.values())
        if self.writer.submit(WriteItem(block, tensors_of(block.arrays), nbytes)):
            return True
        self.reads.count("num_dropped_writes")
        return False

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks: forgotten here at once, deleted from the server by the
        writer (in order with the writes: a block put again afterwards stays)."""
        with self._lock:
            num = sum(self._known.forget(k) for k in keys)
            self._removals.update(dict.fromkeys(keys))
        self.writer.wake()
        return num

    def note_namespace(self, root: bytes, namespace_json: str, runs: RunHints = NO_HINTS) -> None:
        with self._lock:
            self._namespaces[root] = namespace_json
        self.writer.wake()

    def save_counters(self, root: bytes, delta: Mapping[str, object]) -> None:
        """Add this tier's unusable-block counts since the last save to the server's
        record (``prefixcache stats --remote-url`` shows them), with the next batch."""
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
            "queue_max_bytes": self.writer.max_bytes,
            "num_write_failures": self.writer.num_failures,
            **{name: counts.get(name, 0) for name in _COUNTERS},
            **self.gate.stats(),
        }

    @property
    def charges_tenants(self) -> bool:
        return self.shares is not None

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Each tenant's figures here (all hosts': shares.py); empty without shares."""
        return {} if self.shares is None else self.shares.figures()

    # -- internals -------------------------------------------------------------

    def _lookup(self, keys: Sequence[bytes], start: int) -> list[RemoteMeta]:
        """Metas of ``keys[start:]`` while consecutive: one round trip per shard per prompt."""
        last = self.reads.last
        if last is not None and last.keys is keys and last.start <= start:
            return last.metas[start - last.start :]
        if start >= len(keys):
            return []
        found = look_up(self.client, self.names, keys, start, self.reads.unusable)
        if found.stop is not None:  # asked again next time: the shard may be back
            self._miss = (keys[start + len(found.metas)], found.stop)
        self.reads.last = found if found.stop is None else None
        return found.metas

    def _write_batch(self, items: list[WriteItem]) -> None:
        """Encode and send a batch (writer thread). Under tenant shares they keep
        ``remote_max_bytes`` (shares.py), not the servers' memory use."""
        room = self.shares is not None or self.writes.room(sum(i.nbytes for i in items))
        if self.client.off is not None or not room:
            if self.client.off is None:
                self.reads.count("num_no_room", len(items))
            self.reads.count("num_dropped_writes", len(items))
            return
        writes = self.writes
        before = writes.num_refused, writes.num_evicted_unsent
        sent = writes.send(items)
        refused = writes.num_refused - before[0]
        turned = refused + writes.num_evicted_unsent - before[1]  # counted per tenant
        with self._lock:
            for item in sent:
                self._known.add(item.block.key)
            evicted, writes.evicted = writes.evicted, []
            self._known.forget_names(evicted)  # a later put writes them again
            self._counts["num_writes"] += len(sent)
            self._counts["written_bytes"] += sum(it.nbytes for it in sent)
            self._counts["num_no_room"] += refused
            self._counts["num_dropped_writes"] += len(items) - len(sent) - turned

    def _housekeeping(self) -> None:
        """Namespace documents, removals, the counters record (writer thread)."""
        with self._lock:
            notes, self._namespaces = self._namespaces, {}
            removals, self._removals = list(self._removals), {}
            counts = {n: self._counts.get(n, 0) for n in REPORTED}
        if notes and not self.writes.put_namespaces(notes):
            with self._lock:  # try again with a later batch
                self._namespaces = notes | self._namespaces
        if removals:
            self.reads.count("num_removed", self.writes.remove(removals))
        if self.shares is not None and self.reads.used:
            with self._lock:
                used, self.reads.used = self.reads.used, {}
            self.shares.touch(list(used.items()))
        self.writes.report(counts)
