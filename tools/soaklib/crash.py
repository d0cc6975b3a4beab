"""Scenario crash: SIGKILL a process that serves, spills, evicts, runs gc or clear.

After every kill the directory is checked as an operator and a server would:
``prefixcache verify`` (its findings are counted), then a fresh PrefixCache in
this process serves every prompt and each restore is compared with the live
run. Nothing half-written may be served; the bytes on disk stay under the cap.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

from . import common
from .common import Result, Tally, Workload, cli, make_prompts, open_cache

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_BYTES = 8192  # one block of the tiny llama (2 layers x K, V x 2 heads x 16 x 16 fp32)
ACTIONS = ("serve",) * 12 + ("gc",) * 5 + ("clear",) * 3


@dataclass(frozen=True, slots=True)
class CrashSetup:
    kills: int = 50
    seed: int = 0
    groups: int = 8
    per_group: int = 6
    hot_bytes: int = 20 * BLOCK_BYTES  # small: the child spills
    ssd_bytes: int = 90 * BLOCK_BYTES  # smaller than the prompts' blocks: it evicts
    max_delay: float = 2.0  # seconds a child runs (after it is ready) before the kill


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS, env.get("PYTHONPATH")) if p)
    return env


def spawn_server(ssd_dir: str, setup: CrashSetup, seed: int, policy: str, ops: int = 0):
    argv = [
        ssd_dir,
        str(seed),
        policy,
        str(setup.hot_bytes),
        str(setup.ssd_bytes),
        str(setup.groups),
        str(setup.per_group),
        str(ops),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "soaklib.child", *argv],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_until(proc: subprocess.Popen, deadline: float, tally: Tally) -> None:
    """Read ``op`` lines until ``deadline`` (counting wrong restores) or until it exits."""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            return
        line = proc.stdout.readline()
        if not line:
            return
        parts = line.split()
        if parts[0] == "op":
            tally.ops += 1
            tally.checked += int(parts[2]) > 0
            if parts[3] != "1":
                tally.wrong += 1
                tally.findings.append(f"crash child served prompt {parts[1]} wrongly")


def kill_server(ssd_dir: str, setup: CrashSetup, rng: random.Random, tally: Tally) -> str:
    policy = rng.choice(("write_back", "write_through"))
    proc = spawn_server(ssd_dir, setup, rng.randrange(1 << 30), policy)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        tally.errors += 1
        tally.findings.append(f"server child did not start: {line!r} {proc.stderr.read()[-500:]}")
        proc.kill()
        proc.wait()
        return "serve-failed"
    read_until(proc, time.monotonic() + rng.uniform(0.0, setup.max_delay), tally)
    return _kill(proc, "serve")


def kill_cli(ssd_dir: str, setup: CrashSetup, rng: random.Random, action: str) -> str:
    args = ["--ssd-dir", ssd_dir]
    if action == "gc":
        args += ["--max-bytes", str(rng.randrange(setup.ssd_bytes))]
    else:
        args += ["--yes"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache", action, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(rng.uniform(0.2, 1.2))  # the CLI takes ~0.3-0.6 s to start on 2 cores
    return _kill(proc, action)


def _kill(proc: subprocess.Popen, action: str) -> str:
    running = proc.poll() is None
    if running:
        proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return f"{action} killed" if running else f"{action} finished first"


def check_after(work: Workload, ssd_dir: str, setup: CrashSetup, tally: Tally, seen: Counter):
    """verify, reopen, serve every prompt exactly, check the cap."""
    out = cli("verify", "--ssd-dir", ssd_dir, "--json")
    if out.returncode in (0, 1) and out.stdout:
        doc = json.loads(out.stdout)
        for name in ("num_bad", "num_unreadable", "num_detached"):
            seen[f"verify {name[4:]}"] += doc[name]
    elif "does not exist" not in out.stderr and "no SSD tier" not in out.stderr:
        tally.errors += 1
        tally.findings.append(f"verify failed ({out.returncode}): {out.stderr[-300:]}")
    pc = open_cache(
        work.model, ssd_dir, hot_max_bytes=setup.hot_bytes, ssd_max_bytes=setup.ssd_bytes
    )
    seen["temps left after reopen"] += len(common.temp_files(ssd_dir))
    try:
        for i in range(len(work.prompts)):
            work.serve(pc, i, tally, store=False)
        seen["quarantined on reopen"] += pc.stats()["ssd"]["num_corrupt"]
    finally:
        pc.close()
    on_disk = common.payload_bytes(ssd_dir)
    if on_disk > setup.ssd_bytes:
        tally.errors += 1
        tally.findings.append(f"{on_disk} payload bytes on disk > cap {setup.ssd_bytes}")


def run(setup: CrashSetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    work = Workload(make_prompts(setup.groups, setup.per_group))
    rng = random.Random(setup.seed)
    tally, seen = Tally(), Counter()
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-crash-") as tmp:
        ssd_dir = os.path.join(tmp, "ssd")
        for _ in range(setup.kills):
            action = rng.choice(ACTIONS) if os.path.isdir(ssd_dir) else "serve"
            if action == "serve":
                outcome = kill_server(ssd_dir, setup, rng, tally)
            else:
                outcome = kill_cli(ssd_dir, setup, rng, action)
            seen[outcome] += 1
            check_after(work, ssd_dir, setup, tally, seen)
    notes = ", ".join(f"{k}: {v}" for k, v in sorted(seen.items()))
    return tally.result("crash", start, f"{setup.kills} SIGKILLs; {notes}")
