"""Large payload files read through the reader's scratch (``staged.py``): a file of
up to WHOLE_BYTES of data read whole and verified before any byte is placed, a
longer one in slices of whole tensors; both exact, a bad file a counted miss.
Restores through the SSD tier match the live run bit for bit and then grow."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import LAYOUT, check_block
from test_restore_grows import BLOCK, WIDE, config, grow
from test_ssd_runs import assert_in_place, path_of
from test_ssd_stream import chain_dest, flip_byte, placed_into, stored

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import PayloadError
from prefixcache.memory.host import Placed
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd import staged
from prefixcache.tiers.ssd.read_into import Buffers
from prefixcache.tiers.ssd.stream import stream


@pytest.fixture(params=["whole", "sliced"])
def large(request, monkeypatch):
    """Every payload through the large-file path: read whole, or a tensor a slice."""
    monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    if request.param == "sliced":
        monkeypatch.setattr(staged, "WHOLE_BYTES", 0)
        monkeypatch.setattr(staged, "SLICE_BYTES", 1)
    return request.param


def spans_of(sizes: list[int]) -> list[tuple]:
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append((f"t{i}", "U8", (n,), at, at + n))
        at += n
    return out


def test_slices_are_whole_tensors_the_file_whole_when_it_fits(monkeypatch):
    spans = spans_of([4, 4, 10, 1, 1, 1])
    monkeypatch.setattr(staged, "WHOLE_BYTES", 21)
    assert staged.slices(spans) == [(0, 6)]
    monkeypatch.setattr(staged, "WHOLE_BYTES", 20)
    monkeypatch.setattr(staged, "SLICE_BYTES", 8)
    assert staged.slices(spans) == [(0, 2), (2, 3), (3, 6)]  # the 10-byte tensor alone
    assert staged.slices([]) == []


def staged_file(tmp_path, sizes: list[int]) -> tuple[int, list[tuple], bytes, bytes, int]:
    """A file of a 16-byte prefix and random tensors of ``sizes``: (fd, spans,
    prefix, data, its checksum)."""
    prefix = os.urandom(16)
    data = os.urandom(sum(sizes))
    path = tmp_path / "payload"
    path.write_bytes(prefix + data)
    fd = os.open(path, os.O_RDONLY)
    return fd, spans_of(sizes), prefix, data, xxhash.xxh3_64_intdigest(prefix + data)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "sliced"])
def test_a_tensor_lands_in_a_strided_target_only_after_its_file_is_verified(
    tmp_path, monkeypatch, whole
):
    """Targets are strided views (a block's rows of a run region). A good file lands
    bit for bit; with a wrong checksum a file read whole places nothing, where a
    sliced one (the control) has placed its earlier slices when the check fails."""
    if not whole:
        monkeypatch.setattr(staged, "WHOLE_BYTES", 0)
        monkeypatch.setattr(staged, "SLICE_BYTES", 64)
    fd, spans, prefix, data, checksum = staged_file(tmp_path, [128, 128, 96])
    regions = [np.full((1, 2, 8, 16), 7, np.uint8) for _ in range(2)]  # 4 blocks of 2 rows
    targets = [regions[0][:, :, 2:6], regions[1][:, :, 4:8], np.full(96, 7, np.uint8)]
    try:
        with pytest.raises(PayloadError, match="checksum"):
            staged.read_staged(fd, spans, targets, 16, prefix, checksum ^ 1, Buffers(None))
        untouched = [bool((t == 7).all()) for t in targets]
        assert untouched == ([True] * 3 if whole else [False, False, False])
        for t in targets:
            t[...] = 7
        staged.read_staged(fd, spans, targets, 16, prefix, checksum, Buffers(None))
    finally:
        os.close(fd)
    for t, (*_, start, end) in zip(targets, spans, strict=True):
        assert np.ascontiguousarray(t).tobytes() == data[start:end]
    assert (regions[0][:, :, :2] == 7).all() and (regions[0][:, :, 6:] == 7).all()


def test_a_short_file_fails_its_read(tmp_path):
    fd, spans, prefix, _, checksum = staged_file(tmp_path, [64, 64])
    spans = [*spans, ("t2", "U8", (8,), 128, 136)]  # 8 bytes the file does not hold
    targets = [np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(8, np.uint8)]
    try:
        with pytest.raises(PayloadError, match="short read"):
            staged.read_staged(fd, spans, targets, 16, prefix, checksum, Buffers(None))
    finally:
        os.close(fd)


def test_the_large_path_places_every_block_exactly(tier, large):
    keys = stored(tier, 41, 6)
    dest = chain_dest(6)
    out = list(stream(tier.reads, keys, placed_into(dest, skip=set(), names=set(LAYOUT))))
    for i, block in enumerate(out):
        assert all(isinstance(a, Placed) for a in block.arrays.values())
        check_block(block.to_block())  # every element's bits, as written
        assert_in_place(dest, keys[i], i, set(LAYOUT))


def test_a_flipped_data_byte_is_a_miss_placed_nowhere_when_read_whole(tier, large):
    """The control is the sliced read: its earlier tensors were placed before the
    checksum failed (the block is a miss either way)."""
    keys = stored(tier, 42, 5)
    flip_byte(path_of(tier, keys[2]), 1)  # the last tensor's last byte
    dest = chain_dest(5)
    out = list(stream(tier.reads, keys, placed_into(dest, skip=set(), names=set(LAYOUT))))
    assert out[2] is None and tier.stats()["num_corrupt"] == 1
    for i in (0, 1, 3, 4):
        assert_in_place(dest, keys[i], i, set(LAYOUT))
    placed = any(dest[name][:, :, 32:48].any() for name in LAYOUT)
    assert placed == (large == "sliced")


def test_a_restore_through_the_large_path_matches_the_live_run(tmp_path, large):
    model = tiny_model("llama")
    tokens = prompt(43, 6 * 16 + 3)
    cfg = CacheConfig(block_size=16, hot_max_bytes=1, promote=False, ssd_dir=str(tmp_path))
    with PrefixCache(model, cfg, model_id="tiny") as pc:
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        pc.store(tokens, cache)
        pc.flush()
        assert pc.stats()["hot"]["num_blocks"] == 0
        restored, num = pc.fetch(tokens)
        assert num == len(tokens) - 1  # the last token is left to the prefill
        logits = prefill(model, tokens[num:], restored)
        assert max_diff(logits, live_logits(model, tokens, num)) == 0.0
        # the control: one restored block's keys changed, the logits differ
        bad, _ = pc.fetch(tokens)
        bad[0].keys[..., 16:32, :] = bad[0].keys[..., 16:32, :] * 0.5
        wrong = prefill(model, tokens[num:], bad)
        assert max_diff(wrong, live_logits(model, tokens, num)) > 0.0


def test_a_chain_restored_through_the_large_path_grows_with_the_live_logits(tmp_path, large):
    """Prefill past the restored buffers' end, then decode: the live run's logits."""
    model = tiny_model("llama", **WIDE)
    shared = prompt(44, 5 * BLOCK)
    stored_tokens, asked = shared + prompt(45, 20), shared + prompt(46, 300)
    with PrefixCache(model, config("ssd", tmp_path, 0), model_id="t") as pc:
        cache = make_prompt_cache(model)
        prefill(model, stored_tokens, cache, step=BLOCK)
        pc.store(stored_tokens, cache)
        pc.flush()
        del cache
        restored, num = pc.fetch(asked)
    assert num == 5 * BLOCK
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 4)
    got = grow(model, restored, asked[num:], 4)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5
