"""The headers of a run's payload files, parsed and checked once.

The files of a run share one layout (``runs.plan_runs``): as ``encode_header``
writes them, their headers differ only in the block's key and the tensors'
digests, 16 lowercase hex digits each, at the same places. The run's first
header is parsed and checked in full (``payload.parse_layout``); a later one of
the same length and data size whose key is its block's, whose digest places
hold hex digits only, and whose every other byte equals the first header's,
parses to the same tensors and layout (every JSON token outside those places is
the same, and hex digits between quotes are only ever a string's content), so it
is not parsed again. Any other header is parsed and checked in full.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from . import digests as tensor_digests
from .payload import KEY_AT, parse_layout
from .read_into import Span

_DIGEST = re.compile(rb'"(?:xxh3|lead)":"[0-9a-f]{16}"')
_QUOTED = 8  # len('"xxh3":"') == len('"lead":"')
_HEX = np.zeros(256, bool)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = True


class Headers:
    """One run's headers: ``parse`` each file's; ``plans`` holds what a reader
    derived from the run's layout (reused for each header alike to the first)."""

    def __init__(self) -> None:
        self._first: tuple[bytes, int] | None = None  # its text, data bytes
        self._parsed: tuple[tuple[Span, ...], tensor_digests.Layout] | None = None
        self._free = np.zeros(0, np.intp)  # where the key's and digests' digits lie
        self._fixed = np.zeros(0, np.uint8)  # the first header, those places zeroed
        self.plans: dict[object, object] = {}

    def parse(
        self, text: bytes, key: bytes, data_bytes: int
    ) -> tuple[tuple[Span, ...], tensor_digests.Layout | None, bool]:
        """(the header's tensors, its layout, whether it is of the run's first
        header's layout: then ``plans`` apply to it).

        Raises:
            PayloadError: the header is bad (``payload.parse_layout``).
        """
        if self._parsed is not None and self._alike(text, key, data_bytes):
            return *self._parsed, True
        spans, layout = parse_layout(text, key, data_bytes)
        if self._parsed is None and layout is not None:
            self._learn(text, key, data_bytes, spans, layout)
            return spans, layout, True
        return spans, layout, False

    def _learn(
        self,
        text: bytes,
        key: bytes,
        data_bytes: int,
        spans: tuple[Span, ...],
        layout: tensor_digests.Layout,
    ) -> None:
        self._free = _free_at(layout[0], layout[1], 2 * len(key))
        fixed = np.frombuffer(text, np.uint8).copy()
        fixed[self._free] = 0
        self._first, self._parsed, self._fixed = (text, data_bytes), (spans, layout), fixed

    def _alike(self, text: bytes, key: bytes, data_bytes: int) -> bool:
        assert self._first is not None
        first, first_bytes = self._first
        if len(text) != len(first) or data_bytes != first_bytes:
            return False
        if text[KEY_AT : KEY_AT + 2 * len(key)] != key.hex().encode():
            return False
        got = np.frombuffer(text, np.uint8).copy()
        if not _HEX[got[self._free]].all():
            return False
        got[self._free] = 0
        return bool(np.array_equal(got, self._fixed))


@functools.lru_cache(maxsize=64)
def _free_at(cut: int, entries: bytes, key_digits: int) -> np.ndarray:
    """Where the key's and the digests' hex digits lie in a header of this layout
    (``cut``: where its ``entries``, digests zeroed, start): found once per layout."""
    digits = [cut + m.start() + _QUOTED for m in _DIGEST.finditer(entries)]
    free = np.add.outer(np.array(digits, np.intp), np.arange(16)).ravel()
    out = np.concatenate([np.arange(KEY_AT, KEY_AT + key_digits), free])
    out.flags.writeable = False
    return out
