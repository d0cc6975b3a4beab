"""SSD tier: real LMDB, real files, real processes (no mocks, no sleeps)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import lmdb
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ssd_child import ROOT, block_key, check_block, make_block

from prefixcache.blocks import Block, BlockMeta
from prefixcache.config import CacheConfig
from prefixcache.errors import PayloadError, SsdFormatError
from prefixcache.memory.host import tensors_of
from prefixcache.tiers.ssd.admin.maintenance import reconcile
from prefixcache.tiers.ssd.files import payload_path
from prefixcache.tiers.ssd.payload import (
    SMALL_PAYLOAD,
    encode_header,
    read_header,
    read_payload,
    write_payload,
)
from prefixcache.tiers.ssd.tier import SsdTier

CHILD = os.path.join(os.path.dirname(__file__), "ssd_child.py")


@pytest.fixture
def open_tier(tmp_path):
    """Open tiers (default dir: tmp_path/ssd); every one is closed at teardown."""
    tiers: list[SsdTier] = []

    def opener(path=None, writer_hold=None, map_size=1 << 36, **settings) -> SsdTier:
        settings = {"ssd_max_bytes": 1 << 30, "ssd_min_free_bytes": 0, **settings}
        config = CacheConfig(ssd_run_tokens=0, ssd_dir=str(path or tmp_path / "ssd"), **settings)
        tier = SsdTier(config, writer_hold=writer_hold, map_size=map_size)
        tiers.append(tier)
        return tier

    yield opener
    for tier in tiers:
        tier.close()


@contextlib.contextmanager
def tmpfs(path, options: str):
    """Mount a tmpfs at ``path`` (yields False if mounting is not permitted)."""
    path.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    try:
        yield res.returncode == 0 or res.stderr.strip()
    finally:
        if res.returncode == 0:
            subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def tiny_fs(tmp_path, request):
    """A small tmpfs (2 MiB, or the mount options of indirect parametrization)."""
    with tmpfs(tmp_path / "tiny", getattr(request, "param", "size=2m")) as mounted:
        if mounted is not True:
            pytest.skip(f"cannot mount a tmpfs to get a real ENOSPC: {mounted}")
        yield tmp_path / "tiny"


@pytest.fixture
def fast_dir(tmp_path):
    """A roomy tmpfs where fsync is free, else a plain directory."""
    with tmpfs(tmp_path / "fast", "size=256m"):
        yield tmp_path / "fast"


def payload_files(path) -> list[str]:
    """Every file under blocks/ (payloads and temp files)."""
    root = os.path.join(path, "blocks")
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def disk_bytes(path) -> int:
    return sum(os.stat(f).st_size for f in payload_files(path))


def run_child(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True, **kwargs
    )


# -- round trip -----------------------------------------------------------


def test_round_trip_is_bit_exact_for_every_dtype(open_tier, tmp_path):
    tier = open_tier()
    blocks = [make_block(seed, i) for seed in (1, 2) for i in range(5)]
    assert all(tier.put(b) for b in blocks)
    tier.flush()
    for block in blocks:
        loaded = tier.load(block.key)
        check_block(loaded)
        assert (loaded.parent, loaded.root, loaded.index) == (block.parent, ROOT, block.index)
        assert loaded.nbytes == block.nbytes
        meta = tier.get_meta(block.key)
        assert meta.checksum != 0 and meta.file_bytes > meta.nbytes == block.nbytes
    stats = tier.stats()
    assert stats["num_blocks"] == 10 and stats["nbytes"] == disk_bytes(tmp_path / "ssd")
    assert stats["num_writes"] == 10 and stats["num_corrupt"] == 0
    assert tier.load(block_key(9, 0)) is None  # negative control: never stored
    assert tier.get_meta(block_key(9, 0)) is None and not tier.contains(block_key(9, 0))


@pytest.mark.parametrize("reader", ["buffer", "mx_load"])
def test_both_payload_readers_are_exact_and_reject_corruption(tmp_path, reader):
    arrays = {
        "a": mx.arange(-7, 29, dtype=mx.int32).astype(mx.int8).reshape(4, 9),
        "b": mx.array([True, False, True]),
        "c": mx.array(np.arange(60000, 65536, 7, dtype=np.uint16)).view(mx.bfloat16),
        "d": mx.array(2.5, dtype=mx.float16),
        "e": mx.zeros((0, 3), dtype=mx.float32),
        "f": mx.arange(5, dtype=mx.int64) * -(1 << 40),
    }
    mx.eval(arrays)
    key = block_key(50, 0)
    path = payload_path(str(tmp_path), key)
    tensors = tensors_of(arrays)
    size, checksum = write_payload(path, encode_header(tensors, key), tensors)
    got, nbytes = read_payload(path, key, size, checksum, reader=reader)
    assert list(got) == list(arrays) and nbytes == sum(a.nbytes for a in arrays.values())
    for name, arr in arrays.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
        assert bytes(memoryview(got[name])) == bytes(memoryview(arr)), name
    with pytest.raises(PayloadError):
        read_payload(path, block_key(50, 1), size, checksum, reader=reader)  # wrong key
    with pytest.raises(PayloadError):
        read_payload(path, key, size, checksum ^ 1, reader=reader)
    _corrupt_file(path, "flip_data")
    with pytest.raises(PayloadError):
        read_payload(path, key, size, checksum, reader=reader)


def test_read_header_gives_shapes_and_refuses_negative_dims(tmp_path):
    """The header alone (read ahead of a restore, unverified) is still checked
    against the file: a negative dimension pair whose product fits is refused."""
    arrays = {"k": mx.zeros((1, 2, 4, 8), mx.bfloat16), "v": mx.ones((3,), mx.int8)}
    key = block_key(53, 0)
    path = payload_path(str(tmp_path), key)
    tensors = tensors_of(arrays)
    write_payload(path, encode_header(tensors, key), tensors)
    assert read_header(path, key) == [("k", mx.bfloat16, (1, 2, 4, 8)), ("v", mx.int8, (3,))]
    with pytest.raises(PayloadError):
        read_header(path, block_key(53, 1))  # another key's header
    with open(path, "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + length].replace(b"[1,2,4,8]", b"[-1,-2,4,8]")
    assert text != data[8 : 8 + length]
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data[8 + length :])
    with pytest.raises(PayloadError, match="shape"):
        read_header(path, key)


def test_large_blocks_round_trip_through_mx_load(open_tier):
    tier = open_tier()
    big = make_block(51, 0, scale=900)  # > SMALL_PAYLOAD: read with mx.load
    assert big.nbytes > SMALL_PAYLOAD
    tier.put(big)
    tier.flush()
    check_block(tier.load(big.key), scale=900)
    _corrupt_file(payload_path(os.path.join(tier.path, "blocks"), big.key), "flip_data")
    assert tier.load(big.key) is None and tier.stats()["num_corrupt"] == 1


def test_put_is_idempotent(open_tier):
    tier = open_tier()
    block = make_block(1, 0)
    assert tier.put(block) and tier.put(block)
    tier.flush()
    assert tier.put(block)
    tier.flush()
    assert tier.stats()["num_blocks"] == 1 and tier.stats()["num_writes"] == 1


def test_reopen_in_a_new_process_sees_the_blocks(open_tier, tmp_path):
    tier = open_tier()
    for i in range(20):
        tier.put(make_block(3, i))
    tier.close()
    out = subprocess.run(
        [sys.executable, CHILD, "verify", str(tmp_path / "ssd")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["ok", "20"]


def test_other_format_version_is_refused(open_tier, tmp_path):
    open_tier().close()
    env = lmdb.open(str(tmp_path / "ssd" / "index"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"version", b"99")
    env.close()
    with pytest.raises(SsdFormatError, match=r"version 99.*versions 1, 2, 3"):
        SsdTier(
            CacheConfig(
                ssd_run_tokens=0,
                ssd_dir=str(tmp_path / "ssd"),
                ssd_max_bytes=1 << 20,
                ssd_min_free_bytes=0,
            )
        )


# -- crashes and processes ------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_sigkill_while_writing_never_leaves_a_torn_block(open_tier, tmp_path, seed):
    path = str(tmp_path / "ssd")
    kill_after = random.Random(seed).randrange(1, 120)
    child = run_child("write", path, str(seed), "400")
    for _ in range(kill_after):  # kill at a random point of the write stream
        if not child.stdout.readline():
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()

    tier = open_tier(path)
    assert not [f for f in payload_files(path) if f.endswith(".tmp")]  # cleaned on open
    metas = list(tier.iter_meta())
    for meta in metas:
        check_block(tier.load(meta.key))
    assert tier.stats()["num_corrupt"] == 0
    assert reconcile(tier.index) == (0, 0)  # open-time recovery left nothing behind
    assert len(payload_files(path)) == len(metas) == tier.stats()["num_blocks"]


def test_two_processes_write_one_directory_at_once(open_tier, tmp_path):
    path = str(tmp_path / "ssd")
    open_tier(path).close()
    # seeds 21 and 22, plus an overlap: both write chain 23
    children = [
        run_child("write", path, seed, "60", "--wait", stdin=subprocess.PIPE)
        for seed in ("21", "22", "23", "23")
    ]
    for child in children:
        assert child.stdout.readline() == "ready\n"
    for child in children:
        child.stdin.write("go\n")
        child.stdin.close()
    for child in children:
        assert child.stdout.read().endswith("done\n")
        child.stdout.close()
        assert child.wait() == 0
    tier = open_tier(path)
    for seed in (21, 22, 23):
        for i in range(60):
            check_block(tier.load(block_key(seed, i)))
    assert tier.stats()["num_blocks"] == 180 and tier.stats()["num_corrupt"] == 0
    assert len(payload_files(path)) == 180


def test_opening_a_10000_block_directory_is_fast(fast_dir, open_tier):
    # On a tmpfs so that 10,000 fsyncs do not dominate the suite; tools/bench_ssd.py
    # measures the open on the real disk, cold.
    tier = open_tier(fast_dir / "ssd", write_queue_bytes=64 << 20)
    template = make_block(0, 0)
    for i in range(10_000):  # shared arrays, distinct keys: content does not matter here
        tier.put(Block(block_key(30, i), ROOT, ROOT, 0, template.tokens, template.arrays))
    tier.close()
    start = time.perf_counter()
    tier = open_tier(fast_dir / "ssd")
    elapsed = time.perf_counter() - start
    assert tier.stats()["num_blocks"] == 10_000
    print(f"\nopen of a 10,000-block SSD tier: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0  # O(1): no scan of payload files (measured: a few ms)


# -- corruption -----------------------------------------------------------


def _corrupt_file(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "delete":
        os.unlink(path)
    elif how == "truncate":
        os.truncate(path, size - 100)
    else:
        offset = {"flip_data": size - 50, "flip_header": 20, "flip_length": 0}[how]
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("how", ["flip_data", "flip_header", "flip_length", "truncate", "delete"])
def test_corrupt_payload_is_quarantined(open_tier, tmp_path, caplog, how):
    tier = open_tier()
    blocks = [make_block(4, i) for i in range(3)]
    for b in blocks:
        tier.put(b)
    tier.flush()
    path = payload_files(tmp_path / "ssd")
    victim = next(p for p in path if blocks[1].key.hex() in p)
    _corrupt_file(victim, how)
    with caplog.at_level(logging.WARNING, logger="prefixcache.tiers.ssd.tier"):
        assert tier.load(blocks[1].key) is None
        assert tier.load(blocks[1].key) is None  # now simply absent
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert not os.path.exists(victim) and not tier.contains(blocks[1].key)
    stats = tier.stats()
    assert stats["num_corrupt"] == 1 and stats["num_corrupt_total"] == 1
    assert stats["num_blocks"] == 2 and stats["nbytes"] == disk_bytes(tmp_path / "ssd")
    check_block(tier.load(blocks[0].key))  # neighbours unharmed
    check_block(tier.load(blocks[2].key))


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_index_entry_is_quarantined(open_tier, tmp_path, how):
    tier = open_tier()
    blocks = [make_block(5, i) for i in range(3)]
    for b in blocks:
        tier.put(b)
    tier.close()
    env = lmdb.open(str(tmp_path / "ssd" / "index"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(blocks[2].key))
        value = {
            "truncate": value[:-9],
            "flip": value[:40] + b"\xff" + value[41:],
            "garbage": os.urandom(len(value)),
            "empty": b"",
        }[how]
        txn.put(blocks[2].key, bytes(value))
    env.close()
    tier = open_tier()
    assert tier.get_meta(blocks[2].key) is None
    assert tier.load(blocks[2].key) is None
    assert tier.stats()["num_corrupt"] == 1 and tier.stats()["num_blocks"] == 2
    assert len(payload_files(tmp_path / "ssd")) == 2  # its payload went too
    assert tier.stats()["nbytes"] == disk_bytes(tmp_path / "ssd")
    for b in blocks[:2]:
        check_block(tier.load(b.key))
    tier.put(make_block(5, 3, parent=blocks[1].key))  # the index still works
    tier.flush()
    tier.evict_to(0)
    assert tier.stats()["num_blocks"] == 0 and disk_bytes(tmp_path / "ssd") == 0


def test_two_bad_index_entries_are_both_counted(open_tier, tmp_path):
    """Dropping one unreadable entry rebuilds the links, which drops the other too."""
    tier = open_tier()
    blocks = [make_block(13, i) for i in range(3)]
    for b in blocks:
        tier.put(b)
    tier.close()
    env = lmdb.open(str(tmp_path / "ssd" / "index"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        for b in blocks[1:]:
            txn.put(b.key, b"garbage")
    env.close()
    tier = open_tier()
    assert tier.load(blocks[1].key) is None and tier.load(blocks[2].key) is None
    assert tier.stats()["num_corrupt"] == 2 and tier.stats()["num_corrupt_total"] == 2
    assert tier.stats()["num_blocks"] == 1 and len(payload_files(tmp_path / "ssd")) == 1


def test_reconcile_removes_orphans_and_dangling_entries(open_tier, tmp_path):
    tier = open_tier()
    blocks = [make_block(6, i) for i in range(4)]
    for b in blocks:
        tier.put(b)
    tier.flush()
    files = payload_files(tmp_path / "ssd")
    os.unlink(next(p for p in files if blocks[3].key.hex() in p))  # dangling entry
    orphan = os.path.join(os.path.dirname(files[0]), "ab" * 16 + ".safetensors")
    stray_temp = os.path.join(os.path.dirname(files[0]), ".x.999999999.1.tmp")  # dead pid
    for p in (orphan, stray_temp):
        with open(p, "wb") as f:
            f.write(b"junk")
    assert reconcile(tier.index) == (2, 1)
    assert sorted(payload_files(tmp_path / "ssd")) == sorted(
        p for p in files if blocks[3].key.hex() not in p
    )
    assert tier.stats()["nbytes"] == disk_bytes(tmp_path / "ssd")
    for b in blocks[:3]:
        check_block(tier.load(b.key))


# -- capacity -------------------------------------------------------------


def _leaves_first(tier: SsdTier, before: dict[bytes, BlockMeta]) -> dict[bytes, BlockMeta]:
    """No block left the index while a child it had stayed in it."""
    after = {m.key: m for m in tier.iter_meta()}
    gone = before.keys() - after.keys()
    assert not [c for c in after.values() if c.parent in gone and c.key in before]
    return after


def test_capacity_is_never_exceeded_and_leaves_go_first(open_tier, tmp_path):
    tier = open_tier(ssd_max_bytes=40_000, write_queue_bytes=1 << 20)
    rng, lengths, seen = random.Random(0), [0] * 6, {}
    for step in range(120):
        chain = rng.randrange(6)
        tier.put(make_block(chain, lengths[chain]))
        lengths[chain] += 1
        if step % 3 == 2:
            tier.flush()
            assert disk_bytes(tmp_path / "ssd") <= 40_000
            assert tier.stats()["nbytes"] == disk_bytes(tmp_path / "ssd")
            seen = _leaves_first(tier, seen)
    assert tier.stats()["num_evictions"] > 0


def test_lru_order_spares_recently_used_chains(open_tier, tmp_path):
    probe = make_block(0, 0)
    tier = open_tier(write_queue_bytes=1 << 20)
    tier.put(probe)
    tier.flush()
    per_block = tier.stats()["nbytes"]
    tier.remove([probe.key])
    tier.max_bytes = 8 * per_block
    for i in range(4):
        tier.put(make_block(1, i))
        tier.put(make_block(2, i))
    tier.flush()
    tier.touch([block_key(1, i) for i in range(4)])  # chain 1 is hot
    for i in range(4):
        tier.put(make_block(3, i))
        tier.flush()
    kept = {m.key for m in tier.iter_meta()}
    assert all(block_key(1, i) in kept for i in range(4))
    assert not any(block_key(2, i) in kept for i in range(4))  # the whole cold chain


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=30),
    cap_blocks=st.integers(0, 6),
)
def test_capacity_property(tmp_path_factory, ops, cap_blocks):
    path = tmp_path_factory.mktemp("prop")
    per_block = 2 * 1024 + 300  # rough file size of one block
    with SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(path),
            ssd_max_bytes=cap_blocks * per_block,
            write_queue_bytes=1 << 20,
            ssd_min_free_bytes=0,
        )
    ) as tier:
        lengths, seen = [0] * 4, {}
        for chain, touch in ops:
            tier.put(make_block(chain, lengths[chain]))
            lengths[chain] += 1
            if touch:
                tier.touch([block_key(chain, 0)])
            tier.flush()
            assert disk_bytes(path) <= cap_blocks * per_block
            seen = _leaves_first(tier, seen)
        for meta in tier.iter_meta():
            check_block(tier.load(meta.key))


# -- queue policies and pending blocks ------------------------------------


def test_pending_blocks_are_served_before_they_reach_disk(open_tier, tmp_path):
    hold = threading.Event()
    tier = open_tier(writer_hold=hold)
    block = make_block(7, 0)
    assert tier.put(block)
    assert tier.contains(block.key) and payload_files(tmp_path / "ssd") == []
    meta = tier.get_meta(block.key)
    assert isinstance(meta, BlockMeta) and meta.checksum == 0 and meta.nbytes == block.nbytes
    loaded = tier.load(block.key)
    check_block(loaded)
    assert all(loaded.arrays[n] is not block.arrays[n] for n in block.arrays)
    assert tier.stats()["queue_depth"] == 1 and tier.stats()["num_pending_loads"] == 1
    hold.set()
    tier.flush()
    assert len(payload_files(tmp_path / "ssd")) == 1 and tier.get_meta(block.key).checksum
    check_block(tier.load(block.key))


@pytest.mark.parametrize("policy", ["drop", "inline"])
def test_queue_full_policy(open_tier, tmp_path, policy):
    hold = threading.Event()
    one = make_block(8, 0).nbytes
    tier = open_tier(writer_hold=hold, write_queue_bytes=3 * one, queue_full=policy)
    results = [tier.put(make_block(8, i)) for i in range(5)]
    stats = tier.stats()
    assert stats["queue_bytes"] == 3 * one and stats["queue_depth"] == 3
    if policy == "drop":
        assert results == [True, True, True, False, False]
        assert stats["num_dropped_writes"] == 2 and not tier.contains(block_key(8, 4))
    else:
        assert results == [True] * 5 and stats["num_inline_writes"] == 2
        assert tier.get_meta(block_key(8, 4)).checksum != 0  # indexed while the writer waits
    hold.set()
    tier.flush()
    assert tier.stats()["num_blocks"] == (3 if policy == "drop" else 5)


def test_a_write_failure_turns_writes_off_without_raising(tmp_path, caplog):
    tier = SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(tmp_path / "ssd"),
            ssd_max_bytes=1 << 20,
            ssd_min_free_bytes=0,
        )
    )
    block = make_block(9, 0)
    with open(os.path.join(tmp_path, "ssd", "blocks", block.key.hex()[:2]), "wb"):
        pass  # a file where the fan-out directory should be: a real OSError
    sibling = Block.make(block.key[:1] + b"\1" * 15, block.key, ROOT, 1, block.tokens, block.arrays)
    with caplog.at_level(logging.ERROR):
        tier.put(block)
        tier.flush()
        assert tier.put(sibling) is False  # writes are off: a no-op, not an error
        tier.flush()
    stats = tier.stats()
    assert stats["enabled"] == 0 and stats["num_failures"] == 1, stats
    assert stats["num_write_failures"] == 0  # nothing reached the writer thread
    assert tier.load(block.key) is None and tier.load(sibling.key) is None
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "disabled" in errors[0].getMessage(), errors
    assert "Not a directory" in errors[0].getMessage()
    tier.close()  # clean


def test_blocks_written_before_a_failure_in_the_same_batch_are_indexed(tmp_path):
    hold = threading.Event()
    tier = SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(tmp_path / "ssd"),
            ssd_max_bytes=1 << 20,
            ssd_min_free_bytes=0,
        ),
        writer_hold=hold,
    )
    good, bad = make_block(9, 1), make_block(9, 0)
    assert good.key.hex()[:2] != bad.key.hex()[:2]
    with open(os.path.join(tmp_path, "ssd", "blocks", bad.key.hex()[:2]), "wb"):
        pass  # the bad block's fan-out directory cannot be created
    tier.put(good)
    tier.put(bad)  # one batch: good, then bad
    hold.set()
    tier.flush()
    check_block(tier.load(good.key))
    assert tier.load(bad.key) is None and tier.stats()["num_failures"] == 1
    assert reconcile(tier.index) == (0, 0)  # nothing orphaned
    tier.close()


# -- disk full ------------------------------------------------------------


@pytest.mark.parametrize("tiny_fs", ["size=4m,nr_inodes=64"], indirect=True)
def test_disk_full_disables_the_tier_and_keeps_serving(tiny_fs, caplog):
    # Out of inodes: a real ENOSPC that no free-bytes check can foresee.
    with SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(tiny_fs / "ssd"),
            ssd_max_bytes=1 << 30,
            write_queue_bytes=1 << 20,
            ssd_min_free_bytes=0,
        )
    ) as tier:
        first = [make_block(10, i) for i in range(3)]
        for b in first:
            tier.put(b)
        tier.flush()
        with caplog.at_level(logging.ERROR):
            for i in range(3, 200):
                tier.put(make_block(10, i))
                tier.flush()
        stats = tier.stats()
        assert not tier.enabled and stats["enabled"] == 0 and stats["num_disk_full"] >= 1
        disabled = [r for r in caplog.records if "disabled" in r.getMessage()]
        assert len(disabled) == 1 and disabled[0].levelname == "ERROR"
        assert tier.put(make_block(10, 99)) is False  # a no-op now
        for b in first:
            check_block(tier.load(b.key))
        assert not [f for f in payload_files(tiny_fs / "ssd") if f.endswith(".tmp")]


def test_min_free_bytes_is_kept_by_evicting(tiny_fs):
    with SsdTier(
        CacheConfig(
            ssd_run_tokens=0,
            ssd_dir=str(tiny_fs / "ssd"),
            ssd_max_bytes=1 << 30,
            ssd_min_free_bytes=1 << 20,
        )
    ) as tier:
        for i in range(60):
            tier.put(make_block(11, i, scale=8))
            tier.flush()
            st_ = os.statvfs(tiny_fs)
            assert st_.f_bavail * st_.f_frsize >= 1 << 20
        assert tier.enabled and tier.stats()["num_evictions"] > 0


def test_map_grows_when_full(open_tier, caplog):
    tier = open_tier(map_size=64 << 10)  # tiny on purpose
    blocks = [make_block(12, i) for i in range(300)]
    with caplog.at_level(logging.INFO, logger="prefixcache.tiers.ssd.lmdb_env"):
        for b in blocks:
            tier.put(b)
        tier.flush()
    assert any("growing the map" in r.getMessage() for r in caplog.records)
    assert tier.stats()["num_blocks"] == 300
    check_block(tier.load(blocks[-1].key))


def test_a_dropped_entry_loses_its_file_only_once_the_drop_commits(open_tier):
    """Eviction and removal unlink payload files after the index commit: an aborted
    (or killed) transaction leaves entry and file as they were, never an entry
    without its file."""
    tier = open_tier()
    tier.put(make_block(21, 0))
    tier.flush()
    key = block_key(21, 0)
    path = tier.payload_file(key)
    index = tier.index

    def drop_then_fail(txn):
        assert index.entries.drop_key(txn, key) == 1
        raise RuntimeError("abort")

    with pytest.raises(RuntimeError, match="abort"):
        index.transact(drop_then_fail, write=True)
    assert os.path.exists(path) and index.get(key) is not None
    check_block(tier.load(key))
    # control: the same drop, committed, removes both
    assert index.remove([key]) == 1
    assert not os.path.exists(path) and index.get(key) is None
