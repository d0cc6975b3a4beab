"""Primer: pulls later payload files of a restore into the page cache.

While the first streamed block's copy allocates the restore buffers, the
reader threads have nowhere to put later tensors yet. Instead of idling they
read later payload files, a slice at a time, into a scratch buffer: the disk
keeps busy while the pages of the new buffers are faulted in (cold restores).
Files already cached are skipped (an ``RWF_NOWAIT`` probe), so a warm restore
costs one probe per file; without the probe it does nothing. The kernel is
not asked instead (POSIX_FADV_WILLNEED): its extra requests queue in front of
the reads that wait for them, and a cold restore gets slower.
"""

from __future__ import annotations

import os
import threading

# Bytes read per step: each reader keeps one slice in flight.
SLICE = 1 << 20
# Bytes pulled in, in all. The allocation's length bounds it anyway (faulting in
# fresh pages runs at about the disk's speed); the cap keeps a huge chain from
# crowding the page cache. A cold fetch of 1 GiB into fresh buffers is about 1.15x
# faster with a cap of 2 GiB than of 512 MiB, and no faster with 4 GiB
# (tools/bench_ssd_restore.py).
BUDGET = 2 << 30


class Primer:
    """Reads ``files`` ((path, size), in restore order) until ``done`` is set."""

    def __init__(self, files: list[tuple[str, int]], done: threading.Event):
        self.done = done
        self._todo = list(files) if hasattr(os, "RWF_NOWAIT") else []
        self._lock = threading.Lock()
        self._offset = 0  # into the file of _todo[0]
        self._budget = BUDGET

    def step(self, scratch: memoryview) -> bool:
        """Read the next slice of a later file; False when there is nothing to prime."""
        with self._lock:
            path = None
            while self._todo and self._budget > 0 and not self.done.is_set():
                head, size = self._todo[0]
                if self._offset >= size or (self._offset == 0 and cached(head, size)):
                    self._todo.pop(0)
                    self._offset = 0
                    continue
                path, offset = head, self._offset
                self._offset += SLICE
                self._budget -= SLICE
                break
        if path is None:
            return False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return True  # the real read will tell
        try:
            os.preadv(fd, [scratch], offset)
        except OSError:
            pass
        finally:
            os.close(fd)
        return True


def cached(path: str, size: int) -> bool:
    """Whether a file's first byte is in the page cache: the header every restore
    reads, whole file or only its leading tensors (window K/V and state written
    last may never be read), so it stands for what a restore reads. ``size``
    0: nothing to read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return True  # nothing to prime
    try:
        return size == 0 or os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT) == 1
    except OSError:
        return False  # EAGAIN: not cached
    finally:
        os.close(fd)
