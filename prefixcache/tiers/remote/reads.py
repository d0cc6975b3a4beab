"""The remote tier's read side, one object the tier and its readers share.

It keeps the metas of the tier's last chain lookup (a reader sizes the restore
buffers from them with no round trip), counts the blocks loaded and the ones a
reader could not use (forged or corrupt values, missing parts), and feeds the
cost gate the remote rate each load measures. The readers (reader.py) are
handed this object, never the tier.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

from ...errors import MissReason
from ...memory.host import StreamedBlock
from .chain import Chain
from .client import RemoteClient
from .format import RemoteMeta
from .gate import CostGate
from .names import Names
from .seal import Forged

logger = logging.getLogger(__name__)


class RemoteReads:
    """Lookups' metas, load counts and the gate's remote rate of one remote tier.

    Args:
        names, client, gate: the tier's key names, connection and cost gate.
        counts, lock: the tier's counters and the lock that guards them.
    """

    def __init__(
        self,
        names: Names,
        client: RemoteClient,
        gate: CostGate,
        counts: Counter[str],
        lock: threading.Lock,
    ) -> None:
        self.names, self.client, self.gate = names, client, gate
        self.last: Chain | None = None  # the last chain lookup (held / children)
        self.used: dict[bytes, int] | None = None  # names loaded -> index (tenant shares)
        self._counts, self._lock = counts, lock

    def meta_of(self, keys: Sequence[bytes], index: int) -> RemoteMeta | None:
        """Block ``index``'s meta from the last lookup or children listing (no round trip)."""
        last = self.last
        return None if last is None or index >= len(keys) else last.seen.get(keys[index])

    def load_failed(self, key: bytes, reason: MissReason, error: BaseException | None) -> None:
        """Count a block the reader could not use (on the caller's thread)."""
        if reason is MissReason.EVICTED:
            self.count("num_missing_parts")
        elif reason is MissReason.CORRUPT:
            self.unusable(key, error)

    def loaded(self, block: StreamedBlock, seconds: float) -> None:
        """Count a block fetched in ``seconds`` (the gate's remote rate); under tenant
        shares, note it used (the writer thread sends the notes: shares.py)."""
        self.count("num_loads")
        self.count("load_bytes", block.nbytes)
        self.gate.remote.add(block.nbytes, seconds)
        if self.used is not None:
            with self._lock:
                self.used[self.names.name(block.key)] = block.index

    def unusable(self, key: bytes, error: BaseException | None) -> None:
        """Count a block whose value is unusable: forged (a MAC failed) or corrupt."""
        name = "num_forged" if isinstance(error, Forged) else "num_corrupt"
        with self._lock:
            self._counts[name] += 1
            first = self._counts[name] == 1
        log = logger.warning if first else logger.debug
        what = "forged (fails its MAC)" if name == "num_forged" else "unusable"
        log("remote tier: %s block %s (%s): a miss", what, key.hex(), error)

    def count(self, name: str, num: int = 1) -> None:
        with self._lock:
            self._counts[name] += num
