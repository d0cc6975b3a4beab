"""Payload files opened relative to the payloads' root held open for a restore
(``files.PayloadRoot``): one ``openat2`` where the kernel has it, else fan-out
directory then file; either way no symlink below the root is followed, and a
file that is not regular, or not of the index's size, is a counted miss (real
files, real LMDB, the SSD stream's reader threads)."""

from __future__ import annotations

import os
import shutil

import pytest
from ssd_child import block_key, check_block, make_block

from prefixcache.errors import PayloadError
from prefixcache.tiers.ssd import files
from prefixcache.tiers.ssd.files import PayloadRoot, payload_path
from prefixcache.tiers.ssd.stream import stream

HAS_OPENAT2 = files.openat2 is not None


@pytest.fixture(params=["openat2", "two opens"])
def way(request, monkeypatch):
    """Each test runs with openat2 (where the kernel has it) and without it."""
    if request.param == "openat2" and not HAS_OPENAT2:
        pytest.skip("this kernel has no openat2")
    if request.param == "two opens":
        monkeypatch.setattr(files, "openat2", None)
    return request.param


def stored(tier, seed: int, n: int) -> list[bytes]:
    for i in range(n):
        assert tier.put(make_block(seed, i))
    tier.flush()
    return [block_key(seed, i) for i in range(n)]


def damage(tier, key: bytes, how: str, outside) -> str:
    """Replace ``key``'s payload (or its fan-out directory) as ``how`` says; its path."""
    path = payload_path(os.path.join(tier.path, "blocks"), key)
    if how == "copy":  # the control: the same bytes as a regular file
        shutil.copyfile(path, outside)
        os.unlink(path)
        shutil.copyfile(outside, path)
    elif how == "file symlink":  # an exact copy outside: following it would be a hit
        shutil.copyfile(path, outside)
        os.unlink(path)
        os.symlink(outside, path)
    elif how == "fan-out symlink":
        fan_out = os.path.dirname(path)
        os.rename(fan_out, outside)
        os.symlink(outside, fan_out)
    elif how == "directory":
        os.unlink(path)
        os.mkdir(path)
    elif how == "longer":
        with open(path, "ab") as f:
            f.write(b"\0")
    return path


@pytest.mark.parametrize("how", ["copy", "file symlink", "fan-out symlink", "directory", "longer"])
def test_a_restore_follows_no_symlink_and_refuses_odd_files(tier, tmp_path, way, how):
    keys = stored(tier, 71, 6)
    outside = tmp_path / "outside"
    damage(tier, keys[3], how, outside)
    out = [b if b is None else b.to_block() for b in stream(tier.reads, keys)]  # views: copy now
    for i in (0, 1, 2, 4, 5):
        check_block(out[i])
    if how == "copy":  # the same bytes in a regular file are served: the refusals are real
        check_block(out[3])
        assert tier.stats()["num_corrupt"] == 0
        return
    assert out[3] is None
    assert tier.stats()["num_corrupt"] == 1 and tier.get_meta(keys[3]) is None
    if how != "directory" and how != "longer":
        assert os.path.exists(outside)  # the link's target was never touched
    assert (files.openat2 is not None) == (way == "openat2")  # the way asked for was the way taken


def test_payload_root_opens_files_below_it_only_through_directories(tier, tmp_path, way):
    keys = stored(tier, 72, 2)
    blocks = os.path.join(tier.path, "blocks")
    root = PayloadRoot(blocks)
    try:
        path = payload_path(blocks, keys[0])
        fd, size = root.open(path)
        os.close(fd)
        assert size == os.path.getsize(path)
        other = payload_path(blocks, keys[1])
        os.rename(os.path.dirname(other), tmp_path / "away")
        os.symlink(tmp_path / "away", os.path.dirname(other))
        with pytest.raises(PayloadError, match="symlink"):
            root.open(other)
        with pytest.raises(FileNotFoundError):
            root.open(payload_path(blocks, block_key(72, 9)))
    finally:
        root.close()
