"""Scenario diskfull: the SSD tier's filesystem fills up, then space returns.

On a real size-limited tmpfs (mounting needs root; otherwise the scenario is
skipped with the reason) almost filled by filler files, a write-through cache
serves prompts until the tier hits ENOSPC. The filler takes inodes: free
bytes the tier foresees (it evicts its own blocks to fit them), a full inode
table it cannot, so the write itself fails as on a disk filled by others.
Then: serving must go on from the hot tier with exact restores, ``prefixcache
verify`` must find nothing bad and no temp file may be left. The filler is
deleted and new prompts are served: whether the tier takes writes again is
measured and printed (a finding if not). Finally a new PrefixCache on the
directory serves exactly from SSD.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from . import common
from .common import Result, Tally, Workload, cli, make_prompts, open_cache

RETRY = 0.5  # ssd_retry_seconds: how soon a disabled tier may probe the directory again


@dataclass(frozen=True, slots=True)
class DiskFullSetup:
    fs_bytes: int = 16 << 20
    fs_inodes: int = 600
    free_inodes: int = 40  # left free beside the filler
    groups: int = 8
    per_group: int = 6


@contextlib.contextmanager
def tmpfs(path: str, size: int, inodes: int) -> Iterator[str | None]:
    """Mount a small tmpfs; yields None, or why it could not be mounted."""
    os.makedirs(path)
    options = f"size={size},nr_inodes={inodes}"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True
    )
    try:
        yield None if res.returncode == 0 else (res.stderr.strip() or "mount failed")
    finally:
        if res.returncode == 0:
            subprocess.run(["umount", path], check=True)


def fill(path: str, leave: int) -> str:
    """Empty files in ``path/filler`` until ``leave`` inodes are free."""
    filler = os.path.join(path, "filler")
    os.makedirs(filler)
    num = max(0, os.statvfs(path).f_favail - leave)
    for i in range(num):
        open(os.path.join(filler, str(i)), "wb").close()
    return filler


def serve_all(work: Workload, pc, tally: Tally) -> None:
    for i in range(len(work.prompts)):
        work.serve(pc, i, tally)


def check_clean(ssd_dir: str, tally: Tally, what: str) -> str:
    out = cli("verify", "--ssd-dir", ssd_dir, "--json")
    doc = json.loads(out.stdout) if out.stdout else {}
    temps = common.temp_files(ssd_dir)
    if not doc or doc["num_bad"] or doc["num_unreadable"] or temps:
        tally.errors += 1
        tally.findings.append(f"{what}: verify {out.returncode} {out.stdout[-300:]} temps {temps}")
    return f"verify {what}: {doc.get('num_checked', '?')} checked, {doc.get('num_bad', '?')} bad"


def phases(work: Workload, fresh: Workload, ssd_dir: str, filler: str, tally: Tally) -> list[str]:
    notes = []
    pc = open_cache(
        work.model,
        ssd_dir,
        hot_max_bytes=64 << 20,
        write_policy="write_through",
        ssd_retry_seconds=RETRY,
    )
    try:
        serve_all(work, pc, tally)  # fills the disk
        pc.flush()
        ssd = pc.stats()["ssd"]
        notes.append(
            f"disk full: enabled={ssd['enabled']} num_disk_full={ssd['num_disk_full']} "
            f"after {ssd['num_writes']} writes"
        )
        if ssd["enabled"]:
            tally.findings.append("the disk never filled up: enlarge the prompts or shrink the fs")
        hits = tally.checked
        serve_all(work, pc, tally)  # hot-only now
        notes.append(f"served hot-only: {tally.checked - hits} exact restores")
        notes.append(check_clean(ssd_dir, tally, "when full"))
        shutil.rmtree(filler)
        time.sleep(2 * RETRY)  # the tier probes the directory again at its next write after this
        writes = ssd["num_writes"]
        fresh.model = work.model
        serve_all(fresh, pc, tally)
        pc.flush()
        ssd = pc.stats()["ssd"]
        back = ssd["enabled"] == 1 and ssd["num_writes"] > writes
        notes.append(
            f"space returned: tier re-enabled={'yes' if back else 'no'} "
            f"(new writes {ssd['num_writes'] - writes})"
        )
        if not back:
            tally.findings.append("FINDING: the SSD tier stays disabled after space returns")
    finally:
        pc.close()
    pc = open_cache(work.model, ssd_dir, hot_max_bytes=1, promote=False)
    try:
        before = tally.checked
        serve_all(work, pc, tally)
        notes.append(
            f"reopened: enabled={pc.stats()['ssd']['enabled']}, "
            f"{tally.checked - before} exact restores from SSD"
        )
    finally:
        pc.close()
    notes.append(check_clean(ssd_dir, tally, "after reopen"))
    return notes


def run(setup: DiskFullSetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    tally = Tally()
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-diskfull-") as tmp:
        mnt = os.path.join(tmp, "fs")
        with tmpfs(mnt, setup.fs_bytes, setup.fs_inodes) as why_not:
            if why_not is not None:
                return tally.result("diskfull", start, f"SKIPPED: cannot mount a tmpfs: {why_not}")
            work = Workload(make_prompts(setup.groups, setup.per_group, seed=3))
            fresh = Workload.__new__(Workload)
            Workload.__init__(fresh, make_prompts(setup.groups, setup.per_group, seed=4))
            ssd_dir = os.path.join(mnt, "ssd")
            open_cache(work.model, ssd_dir).close()
            filler = fill(mnt, setup.free_inodes)
            notes = phases(work, fresh, ssd_dir, filler, tally)
    return tally.result("diskfull", start, "; ".join(notes))
