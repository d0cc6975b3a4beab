"""A run's payload headers parsed once (``headers.Headers``): a later header of the
first one's layout reuses its parse only where it differs in the key and digests
alone; any other difference is parsed and checked in full (real headers as the
writer encodes them)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.errors import PayloadError
from prefixcache.memory.host import Tensor
from prefixcache.tiers.ssd.headers import Headers
from prefixcache.tiers.ssd.payload import encode_header, parse_layout


def header(key: bytes, seed: int, shape=(1, 2, 4, 8)) -> tuple[bytes, int]:
    """(a header's JSON text as written, its data bytes) for two bf16 tensors."""
    rng = np.random.default_rng(seed)
    tensors = [
        Tensor(name, "BF16", shape, memoryview(rng.bytes(2 * int(np.prod(shape)))))
        for name in ("0.keys", "0.values")
    ]
    return encode_header(tensors, key)[8:], sum(t.data.nbytes for t in tensors)


def test_a_header_of_the_runs_layout_reuses_the_first_parse():
    first, n = header(b"\1" * 16, 0)
    later, _ = header(b"\2" * 16, 1)  # another key, other digests
    assert later != first
    headers = Headers()
    assert headers.parse(first, b"\1" * 16, n)[2]
    spans, layout, alike = headers.parse(later, b"\2" * 16, n)
    assert alike and (spans, layout) == parse_layout(later, b"\2" * 16, n)


@pytest.mark.parametrize("change", ["shape", "digest not hex", "digest a quote"])
def test_any_other_difference_is_parsed_in_full(change):
    first, n = header(b"\1" * 16, 0)
    headers = Headers()
    headers.parse(first, b"\1" * 16, n)
    key = b"\2" * 16
    if change == "shape":  # same length, other tensors: parsed, and refused for the size
        later, _ = header(key, 1, shape=(1, 2, 8, 4))
        assert len(later) == len(first)
        spans, _, alike = headers.parse(later, key, n)
        assert not alike and spans[0][2] == (1, 2, 8, 4)
        return
    later, _ = header(key, 1)
    at = later.index(b'"xxh3":"') + 8
    later = later[:at] + (b"g" if change == "digest not hex" else b'"') + later[at + 1 :]
    if change == "digest a quote":  # the JSON broken there: refused, as a full parse does
        with pytest.raises(PayloadError):
            parse_layout(later, key, n)
        with pytest.raises(PayloadError):
            headers.parse(later, key, n)
        return
    spans, layout, alike = headers.parse(later, key, n)  # valid, but not as the writer writes
    assert not alike and (spans, layout) == parse_layout(later, key, n)


def test_a_header_naming_another_key_is_refused():
    first, n = header(b"\1" * 16, 0)
    headers = Headers()
    headers.parse(first, b"\1" * 16, n)
    later, _ = header(b"\2" * 16, 1)
    with pytest.raises(PayloadError, match="does not match key"):
        headers.parse(later, b"\3" * 16, n)
