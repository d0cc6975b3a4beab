"""A payload's data and a restore buffer start on a 64-byte boundary.

The kernel copies a warm read from the page cache at about half speed where the
destination lies at another offset from a 64-byte boundary than the file's bytes
(tools/bench_read_align.py). So a payload file's header is padded to end on one
(``payload.DATA_ALIGN``) and a restore buffer is used from its first element on
one (``restore_buffers.ALIGN``; MLX's allocator puts it 24 bytes past one on the
CPU): a tensor's pieces and their places then share their offset from it. Files
written before (headers padded to 8 bytes) restore as they did, exactly. The
controls: with headers padded to 8 bytes, some files' data lies off the boundary;
a buffer's start taken as is, where the allocation lies off it, stays off it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import WIDE, address, grow
from test_ssd_run_files import files_on_disk, ssd_config, store

from prefixcache import PrefixCache
from prefixcache.memory import restore_buffers
from prefixcache.tiers.ssd import payload

BLOCK = 16


def data_offsets(root) -> list[int]:
    """Where each payload file's data starts (after its u64 length and header)."""
    out = []
    for path in files_on_disk(root):
        with open(path, "rb") as f:
            out.append(8 + int.from_bytes(f.read(8), "little"))
    return out


def test_every_payload_files_data_starts_on_the_boundary(tmp_path, monkeypatch):
    model = tiny_model("llama", head_dim=32)
    tokens = prompt(1, 10 * BLOCK + 5)  # run files, block files and a tail
    with PrefixCache(model, ssd_config(tmp_path / "a"), model_id="t") as pc:
        store(pc, model, tokens)
    starts = data_offsets(tmp_path / "a" / "ssd")
    assert len(starts) >= 3
    assert [s % 64 for s in starts] == [0] * len(starts)

    monkeypatch.setattr(payload, "DATA_ALIGN", 8)  # the control: headers as before
    with PrefixCache(model, ssd_config(tmp_path / "b"), model_id="t") as pc:
        store(pc, model, tokens)
    assert any(s % 64 for s in data_offsets(tmp_path / "b" / "ssd"))


def test_files_with_headers_padded_as_before_restore_exactly_into_aligned_buffers(
    tmp_path, monkeypatch
):
    model = tiny_model("llama", **WIDE)  # buffers past 1 MiB: made unwritten, in one load
    tokens = prompt(2, 10 * BLOCK)
    asked = [*tokens, *prompt(3, 20)]
    with monkeypatch.context() as m:
        m.setattr(payload, "DATA_ALIGN", 8)
        with PrefixCache(model, ssd_config(tmp_path), model_id="t") as pc:
            store(pc, model, tokens)
    assert any(s % 64 for s in data_offsets(tmp_path / "ssd"))  # files as before
    with PrefixCache(model, ssd_config(tmp_path), model_id="t") as pc:
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == len(tokens)
    starts = [address(a)[0] for c in cache for a in (c.keys, c.values)]
    assert [s % 64 for s in starts] == [0] * len(starts)
    live = make_prompt_cache(model)
    prefill(model, tokens, live, step=BLOCK)
    want = grow(model, live, asked[num:], 4, step=BLOCK)
    got = grow(model, cache, asked[num:], 4, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5

    bad[1].keys[..., BLOCK : 2 * BLOCK, :] *= 0.5  # the control: a restored block changed
    assert max_diff(grow(model, bad, asked[num:], 0, step=BLOCK)[0], want[0]) > 0.0


def test_a_buffer_is_used_from_its_first_element_on_the_boundary():
    flat = mx.zeros((4096 + 64,), mx.uint16)
    mx.eval(flat)
    base = address(flat)[0]
    skew = (24 - base) % 64 // 2  # a view starting 24 bytes past a boundary, as MLX's
    off = flat[skew : skew + 4096 + 32]
    mx.eval(off)
    assert address(off)[0] % 64 == 24
    aligned = restore_buffers._aligned(off, (4, 1024))
    mx.eval(aligned)
    start = address(aligned)[0]
    assert start % 64 == 0 and aligned.shape == (4, 1024)
    assert address(off)[0] < start < address(off)[0] + 64  # the same allocation, no copy
    np.asarray(memoryview(aligned)).reshape(-1)[:] = 7  # written through, as a restore does
    assert int(off[(start - address(off)[0]) // 2]) == 7
    assert address(off[:4096])[0] % 64 == 24  # the control: taken as is, off the boundary
