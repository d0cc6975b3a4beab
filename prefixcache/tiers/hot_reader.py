"""The hot tier's reader: its blocks need no reading, a restore copies them from
the tier itself (through host views the tier keeps per block)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..blocks import Block
from ..errors import MissReason
from .base import TierReader

if TYPE_CHECKING:  # the tier creates its readers: no import at run time
    from .hot import HotTier


class HotReader(TierReader):
    """Hot blocks need no reading: the restore copies them from the tier itself."""

    def __init__(self, hot: HotTier, keys: Sequence[bytes]):
        self.hot, self.keys = hot, keys

    def load(self, index: int) -> Block | None:
        return self.hot.get(self.keys[index])

    def miss(self, index: int) -> MissReason:
        return MissReason.EVICTED  # another thread's eviction since the lookup

    def host_views(self, index: int) -> Mapping[str, np.ndarray] | None:
        key = self.keys[index]
        return self.hot.host_views(key) if key in self.hot else None
