"""SSD tier safety: owner-only files, no symlink followed, hostile headers refused,
run-time failures turned into hot-only serving and recovered (real files, real LMDB)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import struct
import tracemalloc

import pytest
from ssd_child import check_block, make_block

from prefixcache.config import CacheConfig
from prefixcache.errors import PayloadError, SsdDirError
from prefixcache.tiers.ssd.directory import check_dir
from prefixcache.tiers.ssd.payload import MAX_HEADER, PAYLOAD_FORMAT, read_header, read_payload
from prefixcache.tiers.ssd.tier import SsdTier


def _tier(path, **settings) -> SsdTier:
    settings = {"ssd_max_bytes": 1 << 30, "ssd_min_free_bytes": 0, "ssd_run_tokens": 0, **settings}
    return SsdTier(CacheConfig(ssd_dir=str(path), **settings))


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directory_and_files_are_owner_only(tmp_path):
    old = os.umask(0o022)  # the usual umask: it would leave 0755 / 0644
    try:
        with _tier(tmp_path / "new" / "ssd") as tier:
            block = make_block(60, 0)
            tier.put(block)
            tier.flush()
            payload = tier.payload_file(block.key)
    finally:
        os.umask(old)
    ssd = tmp_path / "new" / "ssd"
    assert _mode(ssd) == 0o700 and _mode(ssd / "blocks") == 0o700 and _mode(ssd / "index") == 0o700
    assert _mode(os.path.dirname(payload)) == 0o700 and _mode(payload) == 0o600
    assert {_mode(p) for p in (ssd / "index").iterdir()} == {0o600}


def test_a_payload_symlink_is_refused_not_followed(tmp_path):
    outside = tmp_path / "outside.safetensors"
    with _tier(tmp_path / "ssd") as tier:
        good, evil = make_block(61, 0), make_block(61, 1)
        tier.put(good)
        tier.put(evil)
        tier.flush()
        path = tier.payload_file(evil.key)
        shutil.copyfile(path, outside)  # an exact copy: following it would be a "hit"
        os.unlink(path)
        shutil.copyfile(outside, path)  # control: the same bytes as a regular file are served
        check_block(tier.load(evil.key))
        os.unlink(path)
        os.symlink(outside, path)
        with pytest.raises(PayloadError, match="symlink"):
            read_header(path, evil.key)
        assert tier.load(evil.key) is None  # refused, and quarantined
        assert tier.stats()["num_corrupt"] == 1 and tier.get_meta(evil.key) is None
        assert not os.path.lexists(path) and outside.exists()  # the link went, not its target
        check_block(tier.load(good.key))


def test_a_fan_out_directory_symlink_is_refused(tmp_path):
    with _tier(tmp_path / "ssd") as tier:
        block = make_block(62, 0)
        tier.put(block)
        tier.flush()
        fan_out = os.path.dirname(tier.payload_file(block.key))
        moved = tmp_path / "moved"
        os.rename(fan_out, moved)
        os.symlink(moved, fan_out)
        assert tier.load(block.key) is None and tier.stats()["num_corrupt"] == 1
        assert (moved / os.path.basename(tier.payload_file(block.key))).exists()


def _payload(tmp_path, header: bytes, data_bytes: int, key: bytes) -> tuple[str, int]:
    path = tmp_path / "p.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_bytes)
    return str(path), 8 + len(header) + data_bytes


def _peak(fn) -> tuple[int, BaseException | None]:
    """Peak bytes traced while ``fn`` runs, and what it raised."""
    tracemalloc.start()
    try:
        fn()
        raised = None
    except (PayloadError, ValueError) as e:
        raised = e
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, raised


@pytest.mark.parametrize("reader", ["buffer", "mx_load"])
def test_a_huge_header_is_refused_before_anything_is_allocated(tmp_path, reader):
    key = b"\7" * 16
    # a header length far over MAX_HEADER, in a file big enough to "hold" it
    header = b" " * (MAX_HEADER + 8)
    path, size = _payload(tmp_path, header, 1 << 20, key)
    peak, raised = _peak(lambda: read_payload(path, key, size, 0, reader=reader))
    assert isinstance(raised, PayloadError) and "header length" in str(raised)
    assert peak < 64 << 10, peak  # not even the header was read


def test_the_peak_measure_sees_a_payload_buffer(tmp_path):
    # control for the test above: a valid 1.5 MiB payload read shows up in the peak
    key = b"\7" * 16
    n = 3 << 19
    meta = {"format": PAYLOAD_FORMAT, "key": key.hex()}
    entry = {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}
    header = json.dumps({"__metadata__": meta, "t": entry}).encode()
    header += b" " * (-len(header) % 8)
    path, size = _payload(tmp_path, header, n, key)
    peak, raised = _peak(lambda: read_payload(path, key, size, 0, reader="buffer"))
    assert isinstance(raised, PayloadError) and "checksum" in str(raised)  # read, then checked
    assert peak >= n


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [0, 1 << 40], "data_offsets": [0, 0]},
        {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]},
        {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]},
    ],
)
def test_hostile_shapes_and_types_are_refused(tmp_path, entry):
    key = b"\7" * 16
    meta = {"format": PAYLOAD_FORMAT, "key": key.hex()}
    header = json.dumps({"__metadata__": meta, "t": entry}).encode()
    header += b" " * (-len(header) % 8)
    path, size = _payload(tmp_path, header, 16, key)
    peak, raised = _peak(lambda: read_payload(path, key, size, 0, reader="buffer"))
    assert isinstance(raised, PayloadError), raised
    assert peak < 64 << 10, peak


def test_a_deeply_nested_header_is_a_payload_error(tmp_path):
    key = b"\7" * 16
    header = b"[" * 200_000 + b"]" * 200_000
    path, _size = _payload(tmp_path, header, 0, key)
    with pytest.raises(PayloadError, match="bad safetensors header"):
        read_header(path, key)


# -- the directory ----------------------------------------------------------------


def test_check_dir_names_a_path_that_cannot_be_a_directory(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    with pytest.raises(SsdDirError, match=f"{afile}/x is not usable: Not a directory"):
        check_dir(str(afile / "x"))
    with pytest.raises(SsdDirError, match="exists and is not a directory"):
        check_dir(str(afile))
    check_dir(str(tmp_path / "fine"))  # control


def test_check_dir_refuses_an_index_it_cannot_write(tmp_path):
    # the index directory replaced by a file: the probe write there fails
    ssd = tmp_path / "ssd"
    check_dir(str(ssd))
    shutil.rmtree(ssd / "index")
    (ssd / "index").write_bytes(b"")
    with pytest.raises(SsdDirError, match="index"):
        check_dir(str(ssd))


# -- run-time failure and recovery ---------------------------------------------------


def test_a_failing_directory_turns_writes_off_and_a_retry_turns_them_on(tmp_path, caplog):
    ssd = tmp_path / "ssd"
    with _tier(ssd, ssd_retry_seconds=0) as tier:
        first = make_block(63, 0)
        tier.put(first)
        tier.flush()
        blocks = ssd / "blocks"
        os.rename(blocks, tmp_path / "kept")
        blocks.write_bytes(b"")  # the payload root is now a file: every write fails
        with caplog.at_level(logging.WARNING, logger="prefixcache.tiers.ssd"):
            tier.put(make_block(63, 1))
            tier.flush()
            assert not tier.enabled
            for i in range(2, 5):  # each put while off wakes a probe: still failing
                assert tier.put(make_block(63, i)) is False
                tier.flush()
            assert not tier.enabled
            os.unlink(blocks)
            os.rename(tmp_path / "kept", blocks)  # the cause is gone
            tier.put(make_block(63, 5))  # dropped, but wakes the probe
            tier.flush()
            assert tier.enabled
            assert tier.put(make_block(63, 6)) is True
            tier.flush()
        stats = tier.stats()
        assert stats["num_failures"] == 1 and stats["num_recoveries"] == 1, stats
        check_block(tier.load(first.key))
        check_block(tier.load(make_block(63, 6).key))
        assert tier.load(make_block(63, 1).key) is None
        messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([m for m in messages if "disabled" in m]) == 1, messages
        assert len([m for m in messages if "re-enabled" in m]) == 1, messages
