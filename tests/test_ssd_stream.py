"""ssd_stream: verified zero-copy views, reads into their place, misses for bad blocks,
queued blocks, early stop."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import QUANT_LLAMA, live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import LAYOUT, block_key, check_block, expected_bits, make_block

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.cache import restore as restore_module
from prefixcache.cache.restore import ChainLoad
from prefixcache.codecs.buffer import TokenBuffer
from prefixcache.errors import LayoutMismatchError
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.memory import restore_buffers
from prefixcache.memory.host import HostArray, Placed, StreamedBlock
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd import stream as ssd_stream
from prefixcache.tiers.ssd.files import payload_path
from prefixcache.tiers.ssd.payload import read_header
from prefixcache.tiers.ssd.prime import SLICE, Primer, cached
from prefixcache.tiers.ssd.stream import stream
from prefixcache.tiers.ssd.tier import SsdTier


def stored(tier: SsdTier, seed: int, n: int) -> list[bytes]:
    for i in range(n):
        assert tier.put(make_block(seed, i))
    tier.flush()
    return [block_key(seed, i) for i in range(n)]


def flip_byte(path: str, from_end: int) -> None:
    """Invert one byte of a payload file, ``from_end`` bytes before its end."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextlib.contextmanager
def stored_on_ssd(tmp_path, model, tokens, kv=None):
    """A PrefixCache holding ``tokens``' blocks on the SSD tier only."""
    cfg = CacheConfig(
        ssd_run_tokens=0, block_size=16, hot_max_bytes=1, promote=False, ssd_dir=str(tmp_path)
    )
    if kv is not None:
        cfg = cfg.replace(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    with PrefixCache(model, cfg, model_id="tiny") as pc:
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, kv=kv)
        pc.store(tokens, cache)
        pc.flush()
        assert pc.stats()["hot"]["num_blocks"] == 0  # every block is on the SSD only
        yield pc


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefixcache-ssd-read")]


def test_stream_yields_verified_views_in_chain_order(tier):
    keys = stored(tier, 1, 6)
    before = tier.stats()["num_loads"]
    got = []
    for block in stream(tier.reads, keys):
        assert isinstance(block, StreamedBlock)
        assert all(isinstance(a, HostArray) for a in block.arrays.values())
        got.append(block.index)
        check_block(block.to_block())  # copied out while the view is valid
    assert got == list(range(6))
    assert tier.stats()["num_loads"] == before + 6
    assert not reader_threads()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_bad_payload_is_a_miss_and_quarantined(tier, damage):
    keys = stored(tier, 2, 5)
    path = payload_path(os.path.join(tier.path, "blocks"), keys[2])
    if damage == "delete":
        os.unlink(path)
    elif damage == "flip":
        flip_byte(path, 3)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
    out = [b if b is None else b.to_block() for b in stream(tier.reads, keys)]  # views: copy now
    assert out[2] is None
    for i in (0, 1, 3, 4):
        check_block(out[i])
    assert tier.stats()["num_corrupt"] == 1
    assert tier.get_meta(keys[2]) is None  # quarantined: never served again
    assert next(stream(tier.reads, keys[2:3])) is None


def test_absent_keys_are_misses(tier):
    keys = stored(tier, 3, 2)
    out = list(stream(tier.reads, [keys[0], block_key(3, 99), keys[1]]))
    assert out[1] is None and out[0] is not None and out[2] is not None
    assert tier.stats()["num_corrupt"] == 0


def test_a_block_still_queued_for_the_writer_is_served(tmp_path):
    hold = threading.Event()
    tier = SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(tmp_path / "ssd"),
            ssd_max_bytes=1 << 30,
            ssd_min_free_bytes=0,
        ),
        writer_hold=hold,
    )
    try:
        first = make_block(4, 0)
        assert tier.put(first)
        out = list(stream(tier.reads, [first.key]))
        assert isinstance(out[0], Block)
        check_block(out[0])
        hold.set()
        tier.flush()
        check_block(next(stream(tier.reads, [first.key])).to_block())
    finally:
        hold.set()
        tier.close()


def test_closing_early_stops_the_readers(tier):
    keys = stored(tier, 5, 8)
    gen = stream(tier.reads, keys)
    check_block(next(gen).to_block())
    gen.close()
    assert not reader_threads()


def test_token_buffer_copies_host_arrays_in_place():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1 << 16, (1, 2, 4, 8), dtype=np.uint16) for _ in range(3)]
    host = [HostArray(p.reshape(-1).view(np.uint8), mx.bfloat16, p.shape) for p in parts]
    hot = mx.array(parts[1]).view(mx.bfloat16)
    buf = TokenBuffer(16)
    buf.add(0, host[0])
    buf.add(4, hot)  # an in-memory block between two streamed ones
    buf.add(8, host[2])
    out = np.array(buf.finish().view(mx.uint16))
    assert out.shape == (1, 2, 16, 8)
    np.testing.assert_array_equal(out[:, :, :12], np.concatenate(parts, axis=2))
    assert not out[:, :, 12:].any()  # headroom is zero
    with pytest.raises(LayoutMismatchError):
        buf.add(12, HostArray(np.zeros(64, np.uint8), mx.bfloat16, (1, 1, 4, 8)))


def placed_into(dest: dict[str, np.ndarray], skip: set[int], names: set[str]):
    """A place function writing tensors of ``names`` into ``dest`` (chain-long, per name)."""

    def place(index, name, dtype, shape, count=1):
        if skip.intersection(range(index, index + count)) or name not in names:
            return None
        return dest[name][:, :, index * 16 : (index + count) * 16, :]

    return place


def chain_dest(n: int) -> dict[str, np.ndarray]:
    out = {}
    for name, (dtype, _, shape) in LAYOUT.items():
        out[name] = np.zeros((*shape[:2], 16 * n, shape[3] * dtype.size), np.uint8)
    return out


def test_tensors_are_read_straight_into_their_place(tier):
    keys = stored(tier, 6, 4)
    dest = chain_dest(4)
    place = placed_into(dest, skip={0}, names={"0.keys", "0.values", "1.keys"})
    for block in stream(tier.reads, keys, place):
        kinds = {name: type(a) for name, a in block.arrays.items()}
        if block.index == 0:  # no place for it: the read buffer
            assert set(kinds.values()) == {HostArray}
        else:
            assert kinds == {
                "0.keys": Placed,
                "0.values": Placed,
                "1.keys": Placed,
                "1.values": HostArray,
            }
        check_block(block.to_block())  # Placed.to_mx reads the bytes back from the place
    for name, bits in expected_bits(block_key(6, 1)).items():
        if name != "1.values":
            got = dest[name][:, :, 16:32, :].view(bits.dtype)
            np.testing.assert_array_equal(got, bits)  # the bytes landed where they belong
    assert not dest["0.keys"][:, :, :16].any()  # block 0 was not placed: untouched
    assert not dest["1.values"].any()


def test_a_bad_placed_block_is_still_a_miss(tier):
    keys = stored(tier, 7, 4)
    flip_byte(payload_path(os.path.join(tier.path, "blocks"), keys[2]), 3)
    dest = chain_dest(4)
    out = list(stream(tier.reads, keys, placed_into(dest, skip=set(), names=set(LAYOUT))))
    assert out[2] is None  # its bytes may sit in the place: the caller stops before it
    assert all(isinstance(a, Placed) for a in out[3].arrays.values())
    assert tier.stats()["num_corrupt"] == 1 and tier.get_meta(keys[2]) is None


def test_readers_go_on_with_placed_blocks_while_the_caller_holds_one(tier):
    keys = stored(tier, 9, 8)
    dest = chain_dest(8)
    gen = stream(tier.reads, keys, placed_into(dest, skip={0}, names=set(LAYOUT)))
    first = next(gen)  # held: its HostArrays are views of a reader's buffer
    deadline = time.monotonic() + 10
    while not dest["1.values"][:, :, 16 * 7 :].any() and time.monotonic() < deadline:
        time.sleep(0.01)
    check_block(first.to_block())  # the held block's buffer was not reused meanwhile
    for i in range(1, 8):  # every later block landed without the caller asking
        for name, bits in expected_bits(keys[i]).items():
            got = dest[name][:, :, 16 * i : 16 * (i + 1), :].view(bits.dtype)
            np.testing.assert_array_equal(got, bits)
    assert [b.index for b in gen] == list(range(1, 8))


def test_no_reader_writes_into_a_place_after_close(tier, monkeypatch):
    keys = stored(tier, 8, 24)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", 2 * tier.get_meta(keys[0]).file_bytes)
    dest = chain_dest(24)
    place = placed_into(dest, skip=set(), names=set(LAYOUT))

    def slow_place(*args, **kwargs):
        time.sleep(0.02)  # readers cannot get through the chain before close
        return place(*args, **kwargs)

    gen = stream(tier.reads, keys, slow_place)
    next(gen)
    gen.close()
    assert not reader_threads()  # stopped AND joined before close returned
    before = {name: d.copy() for name, d in dest.items()}
    time.sleep(0.05)
    for name, d in dest.items():
        np.testing.assert_array_equal(d, before[name])
    assert not dest["0.keys"][:, :, 16 * 16 :].any()  # readers never got that far


def test_token_buffer_stays_in_place_once_streamed_into():
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 1 << 16, (1, 2, 4, 8), dtype=np.uint16) for _ in range(3)]
    buf = TokenBuffer(16)
    assert buf.destination(0, mx.bfloat16, (1, 2, 4, 8)) is None  # no buffer yet
    buf.add(0, HostArray(parts[0].reshape(-1).view(np.uint8), mx.bfloat16, parts[0].shape))
    array = buf.array
    address = np.asarray(memoryview(array).cast("B")).ctypes.data
    buf.add(4, mx.array(parts[1]).view(mx.bfloat16))  # a hot block after a streamed one
    region = buf.destination(8, mx.bfloat16, (1, 2, 4, 8))
    assert region.shape == (1, 2, 4, 8 * 2) and region.dtype == np.uint8
    region[...] = parts[2].view(np.uint8)  # a view of the buffer: written in place
    buf.add(8, Placed(region, mx.bfloat16, (1, 2, 4, 8)))
    out = buf.materialize()
    assert out is array and np.asarray(memoryview(out).cast("B")).ctypes.data == address
    got = np.array(out.view(mx.uint16))
    np.testing.assert_array_equal(got[:, :, :12], np.concatenate(parts, axis=2))
    assert buf.destination(8, mx.float16, (1, 2, 4, 8)) is None  # wrong dtype
    assert buf.destination(14, mx.bfloat16, (1, 2, 4, 8)) is None  # past the end
    assert buf.destination(0, mx.bfloat16, (1, 1, 4, 8)) is None  # wrong heads


@pytest.mark.parametrize("ahead", [True, False], ids=["header_ahead", "first_block_allocates"])
@pytest.mark.parametrize("kv", [None, (8, 32, 0)], ids=["fp", "kv8"])
def test_fetch_reads_streamed_blocks_straight_into_the_cache(tmp_path, monkeypatch, kv, ahead):
    """Through a real fetch: every block arrives Placed (the buffers are sized from
    the first block's header before any read; without that, every block after the
    first, which allocates them), and the restore is exact; a block corrupted in
    the middle cuts the match there."""
    if not ahead:
        monkeypatch.setattr(ChainLoad, "specs", lambda self, index: None)
    model = tiny_model("llama", **(QUANT_LLAMA if kv else {}))
    seen: list[tuple[int, set[type]]] = []
    real = restore_module.rebuild

    def watched(fresh, loader, **kwargs):
        load = loader.payloads

        def load_and_note(index, limit):
            payloads, resident = load(index, limit)
            seen.extend((index + j, {type(a) for a in p.values()}) for j, p in enumerate(payloads))
            return payloads, resident

        loader.payloads = load_and_note
        return real(fresh, loader, **kwargs)

    monkeypatch.setattr(restore_module, "rebuild", watched)
    tokens = prompt(9, 6 * 16 + 5)
    with stored_on_ssd(tmp_path, model, tokens, kv) as pc:
        restored, num = pc.fetch(tokens)
        assert num == 6 * 16 + 4  # and the 5-token tail, cut back to leave one to prefill
        assert seen[0] == (0, {Placed} if ahead else {HostArray})
        assert all(kinds == {Placed} for _, kinds in seen[1:]) and len(seen) == 7
        logits = prefill(model, tokens[num:], restored, kv=kv)
        assert max_diff(logits, live_logits(model, tokens, num, kv=kv)) == 0.0

        victim = pc.ssd.get_meta(chain_keys(pc.namespace.root_key(), token_bytes(tokens), 16)[3])
        flip_byte(payload_path(os.path.join(pc.ssd.path, "blocks"), victim.key), 2)
        restored, num = pc.fetch(tokens)
        assert num == 3 * 16  # cut before the bad block, whose bytes were placed
        logits = prefill(model, tokens[num:], restored, kv=kv)
        assert max_diff(logits, live_logits(model, tokens, num, kv=kv)) == 0.0
        negative = prefill(model, tokens[num + 1 :], pc.fetch(tokens)[0], kv=kv)
        assert max_diff(negative, live_logits(model, tokens, num, kv=kv)) > 0.0


def test_a_dropped_restore_frees_its_buffers_without_the_garbage_collector(tmp_path):
    """Nothing (reader threads, places) keeps a restore's buffers alive once the
    caller drops the cache: a reference cycle would hold them until gc runs."""
    tokens = prompt(10, 5 * 16 + 3)
    with stored_on_ssd(tmp_path, tiny_model("llama"), tokens) as pc:
        gc.collect()
        gc.disable()
        try:
            base = mx.get_active_memory()
            restored, num = pc.fetch(tokens)
            assert num == 5 * 16 + 2 and mx.get_active_memory() > base  # with the tail
            del restored
            assert mx.get_active_memory() == base
        finally:
            gc.enable()


def resident_pages(path: str, nbytes: int | None = None) -> int:
    """Pages of ``path`` (of its first ``nbytes``) in the page cache (mincore on a
    mapping: unlike a read probe, it starts no readahead)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path) if nbytes is None else nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def drop_pages(path: str) -> bool:
    """Evict a file's pages; True once none is left. ``POSIX_FADV_DONTNEED`` may
    leave pages another CPU touched last for a moment: asked again until gone."""
    for _ in range(1000):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if resident_pages(path) == 0:
            return True
    return False


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no page-cache probe on this OS")
def test_primer_pulls_uncached_files_into_the_page_cache_until_the_first_block_is_taken(tier):
    keys = stored(tier, 11, 3)
    jobs = ssd_stream._jobs(tier, keys)
    files = [(j.path, j.meta.file_bytes) for j in jobs]
    if not all(drop_pages(path) for path, _ in files):
        pytest.skip("this filesystem keeps the pages cached")
    taken = threading.Event()
    primer = Primer(files[1:], taken)
    scratch = memoryview(bytearray(SLICE))
    while primer.step(scratch):
        pass
    # The outcome, not a count of slices: the kernel may start readahead on the
    # primer's own non-blocking probe and finish it before the primer reads.
    assert all(resident_pages(path) > 0 for path, _ in files[1:])
    assert all(cached(*f) for f in files[1:])
    assert resident_pages(files[0][0]) == 0  # the primer skips the first file
    again = Primer(files[1:], taken)
    assert not again.step(scratch)  # all cached now: nothing to do
    taken.set()
    assert not Primer(files, taken).step(scratch)  # the first block is taken: stop
    assert resident_pages(files[0][0]) == 0


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no page-cache probe on this OS")
def test_a_file_read_only_in_its_leading_part_counts_as_cached(tmp_path):
    """A restore may read a file's header and leading tensors only (window K/V
    and state are written last): that file is cached for the primer and the
    warm check; one whose head is not cached is not, whatever its tail."""
    path = str(tmp_path / "payload")
    size = 64 * mmap.PAGESIZE
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    # (the probe itself may start readahead of what it asks: dropped after each)
    if not drop_pages(path):
        pytest.skip("this filesystem keeps the pages cached")
    assert not cached(path, size)
    assert drop_pages(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
        os.pread(fd, mmap.PAGESIZE, size - mmap.PAGESIZE)  # the tail only
        assert resident_pages(path) > 0 and resident_pages(path, mmap.PAGESIZE) == 0
        assert not cached(path, size)
        assert drop_pages(path)
        os.pread(fd, mmap.PAGESIZE, 0)  # the head
        assert resident_pages(path, mmap.PAGESIZE) == 1
    finally:
        os.close(fd)
    assert cached(path, size)


def test_a_lying_first_header_sizes_no_buffer(tmp_path, monkeypatch):
    """The first block's header is read before its checksum can be: one whose
    tensors claim one token each (as many bytes, spread over many heads) would
    make the buffers capacity times too big. Its shapes are not used, the block
    is a counted corrupt miss, and nothing of that size is allocated."""
    model = tiny_model("llama")
    tokens = prompt(9, 4 * 16 + 1)
    allocated: list[tuple[int, ...]] = []
    real_empty = restore_buffers.empty

    def recording(shape, dtype, **kwargs):
        allocated.append(tuple(shape))
        return real_empty(shape, dtype, **kwargs)

    monkeypatch.setattr(restore_buffers, "empty", recording)
    with stored_on_ssd(tmp_path, model, tokens) as pc:
        first = pc.ssd.get_meta(chain_keys(pc.namespace.root_key(), token_bytes(tokens), 16)[0])
        path = payload_path(os.path.join(pc.ssd.path, "blocks"), first.key)
        with open(path, "rb") as f:
            data = f.read()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        for name, entry in header.items():
            if name != "__metadata__":
                b, h, n, d = entry["shape"]
                entry["shape"] = [b, h * n, 1, d]
        text = json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + data[8 + length :])
        assert read_header(path, first.key)[0][2][2] == 1  # a consistent header

        _, num = pc.fetch(tokens)
        assert num == 0 and pc.stats()["ssd"]["num_corrupt"] == 1
        assert not [shape for shape in allocated if shape[1] > 4]  # heads of the model: 2
