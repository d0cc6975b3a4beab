"""Per-tensor digests of SSD payload files: a restore far past a window layer's window
reads only the tensors it uses, each verified against its own digest, and equals the
live run bit for bit; files written without digests are read and verified whole.

Tiny gemma3_text: window layers 0 and 2 (window 16), global layers 1 and 3, 8-token
blocks, ``snapshot_interval=6``: of a 100-token prompt, blocks 3-5 and 9-11 keep the
window layers' payloads; a restore at 96 uses those of blocks 10-11 only, so blocks
3-5 and 9 have tensors no layer reads (``UNNEEDED``). Bytes read are counted by the
kernel (``rchar`` of /proc/self/io: every read of every thread of this process).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache import capture
from prefixcache.errors import PayloadError
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.memory.host import Tensor
from prefixcache.tiers.ssd import digests as tensor_digests
from prefixcache.tiers.ssd import payload, writes
from prefixcache.tiers.ssd import readers as ssd_readers
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd.files import payload_path

BLOCK = 8
POINT = 96
WINDOW_LAYERS = ("0.", "2.")
SKIPPED_BLOCKS = (3, 4, 5, 9)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


@pytest.fixture(params=["runs", "large"])
def path_kind(request, monkeypatch):
    """Every payload through the small-file runs, or through the large-file reads."""
    if request.param == "large":
        monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    return request.param


@pytest.fixture(params=["digests", "layer-order", "before-digests"])
def written(request, monkeypatch):
    """Files as written now (the window layers' tensors last), with every layer's
    tensors in layer order (as written before that), or as the writer before
    digests wrote them (layer order, no digests)."""
    if request.param != "digests":
        monkeypatch.setattr(capture, "partial_layers", lambda reaches, length: frozenset())
    if request.param == "before-digests":
        old = lambda tensors, key: payload.encode_header(tensors, key, ())  # noqa: E731
        monkeypatch.setattr(writes, "encode_header", old)
    return request.param


@pytest.fixture
def short_gaps(monkeypatch):
    """Tiny tensors skipped too (the default skips stretches of 256 KiB and more)."""
    monkeypatch.setattr(tensor_digests, "MIN_SKIP", 0)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def ssd_only(model, tmp_path) -> PrefixCache:
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=BLOCK,
        snapshot_interval=6,
        checkpoint_tail=0,
        ssd_dir=str(tmp_path),
        ssd_min_free_bytes=0,
        hot_max_bytes=1,
        promote=False,
    )
    return PrefixCache(model, config, model_id="tiny")


def chain_files(pc: PrefixCache, tokens: list[int]) -> list[tuple[bytes, str]]:
    keys = chain_keys(pc.namespace.root_key(), token_bytes(tokens[:POINT]), BLOCK)
    return [(k, payload_path(os.path.join(pc.ssd.path, "blocks"), k)) for k in keys]


def spans_of(path: str, key: bytes):
    """(header bytes, the tensors in file order) of a payload file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return payload.read_spans(fd, key, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def flip_in(path: str, key: bytes, name: str) -> None:
    """Invert one byte in the middle of tensor ``name`` of a payload file."""
    prefix, spans = spans_of(path, key)
    (start, end) = next((s, e) for n, _, _, s, e in spans if n == name)
    at = len(prefix) + (start + end) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def unneeded_bytes(files: list[tuple[bytes, str]]) -> int:
    total = 0
    for i in SKIPPED_BLOCKS:
        _, spans = spans_of(files[i][1], files[i][0])
        total += sum(e - s for n, _, _, s, e in spans if n.startswith(WINDOW_LAYERS))
    return total


def restore(gemma, pc, probe):
    """(tokens restored, max |logits - live logits| past them, the fetch's bytes read)."""
    before = rchar()
    cache, num = pc.fetch(probe)
    read = rchar() - before
    want = live_logits(gemma, probe, num, step=BLOCK)
    return num, max_diff(prefill(gemma, probe[num:], cache, step=BLOCK), want), read


@pytest.mark.parametrize("gate", ["any gap", "default"])
def test_a_restore_far_past_the_window_leaves_unneeded_tensors_unread(
    gemma, tmp_path, monkeypatch, path_kind, written, gate
):
    """The same restore with the digests looked at, and with them ignored (the control:
    every byte read, as the whole-file checksum needs): with digests, exactly the
    unneeded tensors' bytes are not read; files without them are read whole either way,
    and so are files whose unneeded stretches lie between used tensors and are under
    MIN_SKIP (all of them here, in layer order)."""
    if gate == "any gap":
        monkeypatch.setattr(tensor_digests, "MIN_SKIP", 0)
    a = prompt(1, 100)
    probe = a[:POINT] + prompt(5, 6)
    with ssd_only(gemma, tmp_path) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.flush()
        files = chain_files(pc, a)
        total = sum(os.path.getsize(path) for _, path in files)
        skipped = unneeded_bytes(files)
        assert skipped > 0.15 * total
        pc.fetch(probe)  # the first restore's imports read files too
        with monkeypatch.context() as m:
            m.setattr(tensor_digests, "parse", lambda *args: None)
            m.setattr(tensor_digests, "lead", lambda *args: None)
            m.setattr(tensor_digests, "lead_at", lambda *args: None)
            num, diff, whole = restore(gemma, pc, probe)
            assert num == POINT and diff == 0.0
        num, diff, read = restore(gemma, pc, probe)
        assert pc.stats()["ssd"]["num_corrupt"] == 0
    assert num == POINT and diff == 0.0
    assert whole >= total
    # window tensors at the file's end are skipped whatever their size; between
    # used ones, only with the gate open
    if written == "digests" or (written == "layer-order" and gate == "any gap"):
        # (plus one byte of each header the readers' warm check probes)
        assert whole - skipped - 64 <= read <= whole - skipped + ssd_readers._PROBES
    else:
        assert abs(read - whole) <= 64


def test_digests_leave_the_files_safetensors_and_whole_checksummed(gemma, tmp_path):
    a = prompt(1, 100)
    with ssd_only(gemma, tmp_path) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.flush()
        key, path = chain_files(pc, a)[4]
        meta = pc.ssd.get_meta(key)
    prefix, spans = spans_of(path, key)
    assert prefix.count(b'"xxh3":"') == len(spans) == 8
    loaded = mx.load(path)
    assert sorted(loaded) == sorted(n for n, *_ in spans)
    arrays, _ = payload.read_payload(path, key, meta.file_bytes, meta.checksum)
    assert all(mx.array_equal(arrays[n], loaded[n]).item() for n in loaded)


@pytest.mark.parametrize("where", ["used", "unneeded"])
def test_a_flipped_byte_fails_only_where_it_is_read(
    gemma, tmp_path, short_gaps, path_kind, written, where
):
    """A byte flipped in block 4's global layer (used): the block is a miss, the
    restore stops before it, exact. In its window layer (unneeded): never read with
    digests, the restore is whole and exact; without digests the whole-file checksum
    makes the block a miss as before."""
    a = prompt(1, 100)
    probe = a[:POINT] + prompt(5, 6)
    with ssd_only(gemma, tmp_path) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)
        pc.flush()
        key, path = chain_files(pc, a)[4]
        meta = pc.ssd.get_meta(key)
        flip_in(path, key, "1.keys" if where == "used" else "0.keys")
        with pytest.raises(PayloadError, match="checksum"):  # the byte is flipped
            payload.read_payload(path, key, meta.file_bytes, meta.checksum)
        num, diff, _ = restore(gemma, pc, probe)
        corrupt = pc.stats()["ssd"]["num_corrupt"]
    missed = where == "used" or written == "before-digests"
    assert num <= 4 * BLOCK if missed else num == POINT
    assert corrupt == (1 if missed else 0)
    assert diff == 0.0


def test_only_stretches_of_min_skip_bytes_or_at_the_end_are_skipped():
    def spans(*sizes):
        out, at = [], 0
        for i, n in enumerate(sizes):
            out.append((f"{i}.keys", "BF16", (n // 2,), at, at + n))
            at += n
        return out

    big, small = tensor_digests.MIN_SKIP, tensor_digests.MIN_SKIP // 2
    assert tensor_digests.worth_skipping(spans(big, 8, big), [True, False, True])
    assert tensor_digests.worth_skipping(spans(small, small, 8), [True, True, False])
    # a short stretch that ends the file costs no read: skipped; one before a used
    # tensor is not
    assert tensor_digests.worth_skipping(spans(big, 8, small), [True, False, True])
    assert tensor_digests.worth_skipping(spans(8, small), [False, True])
    assert not tensor_digests.worth_skipping(spans(big, 8, small, 8), [True, False, True, False])
    assert not tensor_digests.worth_skipping(spans(small, 8), [True, False])
    assert not tensor_digests.worth_skipping(spans(big, 8), [False, False])


def test_a_lead_digest_covers_the_data_and_the_entries_before_it():
    """Tensor j's lead digest verifies the data of tensors 0..j in one hash call and
    binds their header entries: another byte, or another name, dtype, shape or
    offsets of any of them, fails it."""
    data = [np.arange(n, dtype=np.uint8) * (i + 1) for i, n in enumerate((64, 32, 128))]
    tensors = [
        Tensor(f"{i}.keys", "U8", (len(d),), memoryview(d.tobytes())) for i, d in enumerate(data)
    ]
    spans, at = [], 0
    for t in tensors:
        spans.append((t.name, t.dtype, t.shape, at, at + t.data.nbytes))
        at += t.data.nbytes
    leads = [lead for _, lead in tensor_digests.of_tensors(tensors)]
    flat = np.concatenate(data)
    for j in range(3):
        end = spans[j][4]
        assert tensor_digests.lead_matches(flat[:end], spans[: j + 1], leads[j])
        assert not tensor_digests.lead_matches(flat[:end], spans[: j + 1], leads[j - 1])
    changed = flat.copy()
    changed[70] ^= 1
    assert not tensor_digests.lead_matches(changed[:96], spans[:2], leads[1])
    renamed = [spans[0], ("2.keys", *spans[1][1:])]
    assert not tensor_digests.lead_matches(flat[:96], renamed, leads[1])
    reshaped = [spans[0], (spans[1][0], "U8", (2, 16), *spans[1][3:])]
    assert not tensor_digests.lead_matches(flat[:96], reshaped, leads[1])
    # the seeds packed once for a run's files bind the entries alike
    packed = tensor_digests.packed_seeds(spans[:2])
    assert tensor_digests.lead_matches(flat[:96], spans[:2], leads[1], packed)
    assert not tensor_digests.lead_matches(changed[:96], spans[:2], leads[1], packed)
    wrong = tensor_digests.packed_seeds(renamed)
    assert not tensor_digests.lead_matches(flat[:96], spans[:2], leads[1], wrong)
