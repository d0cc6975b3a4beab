"""Maintenance of an SSD tier directory: verify, garbage-collect, clear.

Each operation reads the index, decides, then removes blocks through the index
(entries and payload files go together, in short write transactions), so it
is safe while servers use the directory. A block whose parent is not stored
is *detached*: no fetch can reach it through the SSD tier. While another
process has the directory open that is normal under ``write_back`` (the parent
may still be in its RAM), so detached blocks are only reported then, never
removed and never counted as errors.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ....blocks import BlockMeta
from ....errors import PayloadError
from .. import space
from ..files import list_files
from ..index import SsdIndex
from ..payload import read_payload
from .inventory import Entry, Inventory, scan
from .view import SsdView

_REMOVE_CHUNK = 256


@dataclass(slots=True)
class VerifyReport:
    """Outcome of :func:`verify`. ``bad``: key -> reason (payload or entry)."""

    num_blocks: int = 0
    num_checked: int = 0
    bad: dict[bytes, str] = field(default_factory=dict)
    unreadable: dict[bytes, str] = field(default_factory=dict)  # I/O errors: no verdict
    detached: dict[bytes, str] = field(default_factory=dict)
    num_unreachable: int = 0  # blocks in detached subtrees, their tops included
    quarantined: list[bytes] = field(default_factory=list)
    other_pids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.bad or self.unreadable or (self.detached and not self.other_pids))


def verify(
    view: SsdView, *, quarantine: bool = False, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check every payload's checksum and every chain's links.

    Args:
        view: the directory (``writable`` if ``quarantine``).
        quarantine: drop bad blocks (entry and file), as a load that found them would.
        progress: called with (blocks checked, total) after each block.
    """
    report = VerifyReport(other_pids=view.records.other_pids())
    rows = list(scan(view))
    report.num_blocks = len(rows)
    files: dict[bytes, tuple[bool, str] | None] = {}  # run files checked: each once
    gone: dict[bytes, tuple[bool, str]] = {}  # dropped with a bad block of their run file
    for key, raw, meta in rows:
        problem = _check(view, key, meta, files)
        if problem is not None and view.index.get(key) != raw:
            problem = gone.get(key)  # else evicted or rewritten while we read: a race
        if problem is not None:
            bad, why = problem
            (report.bad if bad else report.unreadable)[key] = why
            dropped: list[bytes] = []
            if bad and quarantine and view.index.quarantine(key, raw, dropped):
                report.quarantined += dropped  # the run file's other blocks with it
                gone.update((k, problem) for k in dropped)
        report.num_checked += 1
        if progress is not None:
            progress(report.num_checked, report.num_blocks)
    inv = Inventory.load(view)
    report.detached = inv.broken()
    report.num_unreachable = len(inv.descendants(report.detached))
    return report


def _check(
    view: SsdView, key: bytes, meta: BlockMeta | None, files: dict[bytes, tuple[bool, str] | None]
) -> tuple[bool, str] | None:
    """None if the block reads back intact, else (is it bad, why); I/O errors are not
    bad. A run file is read and verified once (``files``) for all its blocks."""
    if meta is None:
        return True, "index entry does not decode"
    run = view.index.get_runs([key])[0][1]
    if run is not None:
        if run.file_key not in files:
            # its blocks' bytes differ where some keep extras: the checksum covers them
            size = (meta.file_bytes, meta.checksum, None)
            files[run.file_key] = _check_file(view.payload_file(run.file_key), run.file_key, *size)
        return files[run.file_key]
    return _check_file(view.payload_file(key), key, meta.file_bytes, meta.checksum, meta.nbytes)


def _check_file(
    path: str, key: bytes, file_bytes: int, checksum: int, nbytes: int | None
) -> tuple[bool, str] | None:
    try:
        _, got = read_payload(path, key, file_bytes, checksum)
    except FileNotFoundError:
        return True, "payload file is missing"
    except PayloadError as e:
        return True, str(e)
    except OSError as e:
        return False, f"cannot read: {e}"
    if nbytes is not None and got != nbytes:
        return True, f"payload holds {got} bytes, index says {nbytes}"
    return None


@dataclass(slots=True)
class GcPlan:
    """What :func:`plan_gc` selected: blocks to remove (leaves first) and why."""

    remove: list[bytes] = field(default_factory=list)
    num_selected: int = 0  # matched --older-than, or every block of the scope (--all)
    num_below: int = 0  # descendants of selected blocks (unreachable once they go)
    num_evicted: int = 0  # LRU leaves evicted for --max-bytes
    num_detached: int = 0  # detached subtrees (only when no other process is open)
    nbytes: int = 0
    num_tokens: int = 0


def plan_gc(
    inv: Inventory,
    *,
    model: str | None = None,
    older_than: float | None = None,
    max_bytes: int | None = None,
    select_all: bool = False,
    drop_detached: bool = True,
    now: float | None = None,
) -> GcPlan:
    """Choose blocks to remove.

    ``model`` is a filter: it scopes every other criterion to the model's
    namespaces (and alone selects nothing but the scope's detached blocks).
    ``select_all`` selects every block of the scope; ``older_than`` (seconds)
    selects blocks not used for that long; descendants of a selected block go
    too. Then LRU leaves of the scope are evicted until the scope holds at
    most ``max_bytes`` payload file bytes.
    """
    now = time.time() if now is None else now
    roots = inv.roots(model)
    scope = inv.blocks(roots)
    if select_all:
        chosen = {e.key for e in scope}
    elif older_than is not None:
        chosen = {e.key for e in scope if now - e.last_used > older_than}
    else:
        chosen = set()
    plan = GcPlan(num_selected=len(chosen))
    if drop_detached:
        detached = inv.descendants(inv.broken(roots)) - chosen
        plan.num_detached = len(detached)
        chosen |= detached
    below = inv.descendants(chosen)
    plan.num_below = len(below) - len(chosen)
    if max_bytes is not None:
        evicted = _evict_lru(inv, [e for e in scope if e.key not in below], max_bytes)
        plan.num_evicted = len(evicted)
        below |= evicted
    gone = sorted((inv.entries[k] for k in below), key=lambda e: (-e.index, e.key))
    plan.remove = [e.key for e in gone]
    plan.nbytes = sum(e.file_bytes for e in gone)
    plan.num_tokens = sum(e.num_tokens for e in gone)
    return plan


def _evict_lru(inv: Inventory, kept: list[Entry], max_bytes: int) -> set[bytes]:
    """Least recently used leaves of ``kept`` until it holds at most ``max_bytes``."""
    alive = {e.key: e for e in kept}
    total = sum(e.file_bytes for e in kept)
    num_kids = {k: sum(c in alive for c in inv.children.get(k, [])) for k in alive}
    heap = [(e.last_used, e.key) for e in kept if num_kids[e.key] == 0]
    heapq.heapify(heap)
    out: set[bytes] = set()
    while total > max_bytes and heap:
        _, key = heapq.heappop(heap)
        e = alive[key]
        out.add(key)
        total -= e.file_bytes
        if e.parent in num_kids:
            num_kids[e.parent] -= 1
            if num_kids[e.parent] == 0:
                heapq.heappush(heap, (alive[e.parent].last_used, e.parent))
    return out


def remove(view: SsdView, keys: list[bytes]) -> int:
    """Remove blocks in short transactions (leaves first); returns how many were indexed."""
    chunks = range(0, len(keys), _REMOVE_CHUNK)
    return sum(view.index.remove(keys[i : i + _REMOVE_CHUNK]) for i in chunks)


def stray_files(view: SsdView, inv: Inventory) -> tuple[int, int]:
    """(payload or temp files no entry owns, entries without a payload file), read only.

    Counts files being written right now as stray; ``reconcile`` does not.
    """
    files, temps = list_files(os.path.join(view.path, "blocks"))
    indexed = set(inv.entries) | set(inv.bad)
    orphans = sum(key not in indexed for key in files) + len(temps)
    dangling = sum(key not in files for key in indexed)
    return orphans, dangling


def reconcile(index: SsdIndex) -> tuple[int, int]:
    """Full scan: remove orphan payload/temp files and dangling or bad entries.

    Also rebuilds the LRU, the child links and the byte total from the entries.
    Returns (orphan files removed, dangling entries removed).
    """
    files, temps = list_files(index.entries.payloads)
    index.clear_dead_writes()
    return index.transact(lambda t: space.reconcile(t, index.entries, files, temps), write=True)
