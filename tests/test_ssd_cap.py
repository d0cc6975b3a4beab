"""The SSD tier's cap holds at every moment, not only once a write settles.

An entry dropped in a write transaction (an eviction, a removal, a quarantine)
has its payload file unlinked once that transaction commits. If another
thread's reservation could use the freed room and write its file before that
unlink, both files would be on disk at once: the cap exceeded for a moment.
Here the dropping thread is held right at its unlink (as a busy process may
deschedule it), while the writer tries to use the room: in the same process,
and from another process on the same directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from ssd_child import make_block

from prefixcache import CacheConfig
from prefixcache.tiers.ssd import entries as entries_module
from prefixcache.tiers.ssd.tier import SsdTier


def on_disk(path) -> int:
    root = os.path.join(path, "blocks")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def held_unlink(monkeypatch):
    """Unlinks made by the thread named ``remover`` wait for ``go``; ``entered``
    is set when the first one starts."""
    entered, go = threading.Event(), threading.Event()
    unlink = entries_module.unlink

    def slow_unlink(path: str) -> None:
        if threading.current_thread().name == "remover":
            entered.set()
            go.wait(30)
        unlink(path)

    monkeypatch.setattr(entries_module, "unlink", slow_unlink)
    yield entered, go
    go.set()


def test_a_write_never_lands_beside_a_dropped_file_not_yet_unlinked(tmp_path, held_unlink):
    entered, go = held_unlink
    blocks = [make_block(seed, 0) for seed in range(1, 6)]
    probe = SsdTier(CacheConfig(ssd_dir=str(tmp_path / "probe"), ssd_min_free_bytes=0))
    probe.put(blocks[0])
    probe.close()
    one = on_disk(tmp_path / "probe")
    cap = 4 * one
    path = tmp_path / "ssd"
    tier = SsdTier(CacheConfig(ssd_dir=str(path), ssd_max_bytes=cap, ssd_min_free_bytes=0))
    try:
        for block in blocks[:4]:
            assert tier.put(block)
        tier.flush()
        assert on_disk(path) == cap
        remover = threading.Thread(
            target=tier.index.remove, args=([blocks[0].key],), name="remover"
        )
        remover.start()
        assert entered.wait(30)  # committed, its file not yet unlinked
        assert tier.put(blocks[4])  # the writer reserves the room the removal freed
        deadline = time.monotonic() + 3
        while tier.stats()["num_writes"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # a write that waits for the unlink never comes: bounded look
        assert on_disk(path) <= cap, f"{on_disk(path)} bytes on disk, cap {cap}"
        go.set()
        remover.join()
        tier.flush()
        assert tier.stats()["num_writes"] == 5
        assert on_disk(path) <= cap
        assert tier.contains(blocks[4].key) and not tier.contains(blocks[0].key)
    finally:
        go.set()
        tier.close()


# a process that removes one block and is held at its unlink until a line on stdin
HELD_REMOVER = """
import sys
from prefixcache import CacheConfig
from prefixcache.tiers.ssd import entries
from prefixcache.tiers.ssd.tier import SsdTier
from ssd_child import block_key

unlink = entries.unlink
def held(path):
    print("held", flush=True)
    sys.stdin.readline()
    unlink(path)
entries.unlink = held
tier = SsdTier(CacheConfig(ssd_dir=sys.argv[1], ssd_min_free_bytes=0), record_limits=False)
tier.index.remove([block_key(1, 0)])
tier.close()
print("done", flush=True)
"""


def test_a_write_never_lands_beside_another_process_s_dropped_file(tmp_path):
    """The remover is another process: the write lock spans processes (a file lock)."""
    blocks = [make_block(seed, 0) for seed in range(1, 6)]
    probe = SsdTier(CacheConfig(ssd_dir=str(tmp_path / "probe"), ssd_min_free_bytes=0))
    probe.put(blocks[0])
    probe.close()
    cap = 4 * on_disk(tmp_path / "probe")
    path = tmp_path / "ssd"
    tier = SsdTier(CacheConfig(ssd_dir=str(path), ssd_max_bytes=cap, ssd_min_free_bytes=0))
    child = None
    try:
        for block in blocks[:4]:
            assert tier.put(block)
        tier.flush()
        assert on_disk(path) == cap
        child = subprocess.Popen(
            [sys.executable, "-c", HELD_REMOVER, str(path)],
            cwd=os.path.dirname(__file__),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline() == "held\n"  # committed, its file not yet unlinked
        assert tier.put(blocks[4])  # this process's writer reserves the room it freed
        deadline = time.monotonic() + 3
        while tier.stats()["num_writes"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # a write that waits for the unlink never comes: bounded look
        assert on_disk(path) <= cap, f"{on_disk(path)} bytes on disk, cap {cap}"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        tier.flush()
        assert tier.stats()["num_writes"] == 5
        assert on_disk(path) <= cap
        assert tier.contains(blocks[4].key) and not tier.contains(blocks[0].key)
    finally:
        if child is not None:
            child.kill()
            child.wait()
        tier.close()
