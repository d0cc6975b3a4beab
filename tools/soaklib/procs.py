"""Scenario procs: server processes share one SSD directory with the operator's CLI.

Each worker serves random prompts (fetch, exactness check, store) with small
hot and SSD budgets, half write-back, half write-through. Meanwhile this
process runs ``prefixcache gc`` (plain and with ``--max-bytes``), ``stats``,
``ls`` and ``verify`` in turn, and samples the payload bytes on disk (a walk
that skips files changed during it, so it never over-counts).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

from . import common
from .common import Result, Tally, cli
from .crash import BLOCK_BYTES, CrashSetup, spawn_server


@dataclass(frozen=True, slots=True)
class ProcSetup:
    procs: int = 4
    ops: int = 500  # per process
    seed: int = 0
    hot_bytes: int = 16 * BLOCK_BYTES
    ssd_bytes: int = 60 * BLOCK_BYTES


def drain(proc, tally: Tally, lock: threading.Lock) -> None:
    """Count a worker's op lines until it exits."""
    for line in proc.stdout:
        parts = line.split()
        with lock:
            if parts[0] == "op":
                tally.ops += 1
                tally.checked += int(parts[2]) > 0
                if parts[3] != "1":
                    tally.wrong += 1
                    tally.findings.append(f"worker {proc.pid} served prompt {parts[1]} wrongly")


def operate(ssd_dir: str, setup: ProcSetup, rng: random.Random, tally: Tally, seen: Counter):
    """One CLI command beside the servers; its failures are errors."""
    command = rng.choice(("gc", "gc-max", "stats", "ls", "verify"))
    args = ["--ssd-dir", ssd_dir, "--json"]
    if command == "gc-max":
        args += ["--max-bytes", str(rng.randrange(setup.ssd_bytes))]
    out = cli(command.removesuffix("-max"), *args)
    seen[command] += 1
    allowed = (0, 1) if command in ("ls", "verify") else (0,)
    if out.returncode not in allowed:
        tally.errors += 1
        tally.findings.append(f"{command} exited {out.returncode}: {out.stderr[-300:]}")
    elif command == "verify":
        doc = json.loads(out.stdout)
        seen["verify detached (servers alive)"] += doc["num_detached"]
        seen["verify runs reporting bad blocks"] += bool(doc["num_bad"])
        for item in doc["bad"] + doc["unreadable"]:
            # still indexed: a real problem; gone: evicted while verify read it (verify
            # re-reads the entry to rule such races out; files go after their entry commits)
            gone = cli("show", item["key"], "--ssd-dir", ssd_dir).returncode == 1
            seen["verify false bad: block evicted meanwhile" if gone else "verify real bad"] += 1
            if not gone:
                tally.errors += 1
                tally.findings.append(f"verify beside servers: {item}")


def run(setup: ProcSetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    tally, seen, lock = Tally(), Counter(), threading.Lock()
    rng = random.Random(setup.seed)
    max_seen = 0
    crash_setup = CrashSetup(hot_bytes=setup.hot_bytes, ssd_bytes=setup.ssd_bytes)
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-procs-") as tmp:
        procs = [
            spawn_server(
                tmp,
                crash_setup,
                setup.seed * 100 + p,
                ("write_back", "write_through")[p % 2],
                setup.ops,
            )
            for p in range(setup.procs)
        ]
        for p in procs:  # the CLI needs the directory: wait until every server opened it
            line = p.stdout.readline()
            if line.strip() != "ready":
                tally.errors += 1
                tally.findings.append(f"worker did not start: {line!r}")
        readers = [threading.Thread(target=drain, args=(p, tally, lock)) for p in procs]
        for r in readers:
            r.start()
        while any(p.poll() is None for p in procs):
            operate(tmp, setup, rng, tally, seen)
            max_seen = max(max_seen, common.on_disk_now(tmp))
        for p, r in zip(procs, readers, strict=True):
            r.join()
            err = p.stderr.read()
            if p.wait() != 0:
                tally.errors += 1
                tally.findings.append(f"worker exited {p.returncode}: {err[-400:]}")
        final = common.payload_bytes(tmp)
    if max(max_seen, final) > setup.ssd_bytes:
        tally.errors += 1
        tally.findings.append(f"{max(max_seen, final)} B on disk > cap {setup.ssd_bytes}")
    cmds = ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))
    notes = (
        f"{setup.procs} processes x {setup.ops} ops; beside them: {cmds}; "
        f"max sampled on disk {max_seen} B, final {final} B, "
        f"cap {setup.ssd_bytes} B"
    )
    return tally.result("procs", start, notes)
