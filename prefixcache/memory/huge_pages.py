"""Transparent huge pages for a new buffer that a restore is about to write whole."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_HUGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux's value (6.1 on); Python's mmap names it from 3.13 on
_libc = None


def advise_huge(host: np.ndarray) -> None:
    """Put a new, untouched buffer on transparent huge pages, where Linux gives them.

    A restore writes a whole buffer at once, so 2 MiB pages waste little, and
    they make its fresh pages several times cheaper to fault in (one fault per
    2 MiB) and the copies into them faster (tools/bench_ssd_restore.py: warm
    fetch of 1 GiB ~1.35x, with reused buffers ~1.6x). The 2 MiB regions inside
    the buffer are advised (``MADV_HUGEPAGE``). The two at its ends are shared
    with its neighbours (a restore's buffers lie one after the other), and the
    first holds the allocator's chunk header (and MLX's size), written before
    any advice: a region where a small page is mapped never gets a huge page on
    a fault, so a 4.25 MiB buffer had half its memory in small pages (~15,600
    faults per fetch of a 128 MiB chain; tools/bench_blocks.py). Such a region,
    partly in memory (``mincore``), is collapsed into a huge page at once
    (``MADV_COLLAPSE``, Linux 6.1; the bytes already there are kept): about 5x
    cheaper than faulting in 512 small pages (tools/bench_page_faults.py). A
    region all in memory (recycled, or a huge page already) has nothing left
    to fault and is left alone: a collapse waits for every CPU's page lists to
    drain, a wait that grows on a busy machine. A region shared with another
    mapping stays as it is. Hints the kernel may decline (THP "never", no 2 MiB
    page free, an older kernel); ``PREFIXCACHE_HUGE_PAGES=0`` turns them off.
    """
    global _libc
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if host.nbytes < _HUGE or advice is None or os.environ.get("PREFIXCACHE_HUGE_PAGES") == "0":
        return  # (the size first: numpy's ``ctypes.data`` costs ~10 us)
    data = host.ctypes.data
    stop = data + host.nbytes
    start, end = -(-data // _HUGE) * _HUGE, stop // _HUGE * _HUGE  # the regions inside
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    if end > start:  # a failure only loses the hint
        _libc.madvise(start, end - start, advice)
    for edge in {start - _HUGE if data < start else None, end if stop > end else None}:
        if edge is not None and _partly_in_memory(edge):
            _libc.madvise(edge, _HUGE, _MADV_COLLAPSE)


def _partly_in_memory(region: int) -> bool:
    """Whether some pages of the 2 MiB ``region`` are in memory and some are not
    (False where it is not all mapped)."""
    pages = np.empty(_HUGE // mmap.PAGESIZE, np.uint8)  # mincore's answer: a byte a page
    if _libc.mincore(region, _HUGE, pages.ctypes.data) != 0:
        return False
    present = int(np.count_nonzero(pages & 1))
    return 0 < present < len(pages)
