"""Scenario sustained (serve): a real ``prefixcache serve`` under 4 clients, a kill -9
in the middle, a restart on the same directory.

The tiny llama saved to a directory, served with a 2 MiB hot budget and a
16 MiB SSD cap, block 16 (every other setting at its default). 4 client
threads send chats (4 system prompts, random user turns, greedy, 4 tokens
streamed) back to back (``rate`` 0) or each at ``rate`` requests per second.
Every ``every`` seconds a sample from the server's ``/metrics`` and /proc:
RSS, the cache's RAM by part, the writer's queue, blocks written and dropped,
bytes on disk, hit share and median time to first token since the last
sample. Halfway: the clients pause, the writer's queue drains, a few probe
prompts are answered one at a time, the indexed blocks are listed
(``prefixcache ls``), and the server is killed with SIGKILL. A new server on
the same directory must list every one of those blocks, pass ``prefixcache
verify``, and answer the probes as before the kill; then the run goes on.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from reuselib.servers import Server, free_port

from .chat_load import Chats, Clients
from .common import Result, Tally
from .sustained import COLUMNS, SustainedSetup, check_growth, rss, summary
from .sustained_plot import write

MiB = 1 << 20
PROBES = 6


class Served(Server):
    """``prefixcache serve`` with its metrics page on ``metrics_port``."""

    def __init__(self, argv: list[str], log: Path, metrics_port: int):
        super().__init__("prefixcache", [*argv, "--metrics-port", str(metrics_port)], log)
        self.metrics_port = metrics_port


def metrics(server: Served) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("prefixcache_")] = float(value)
    return out


def start(model: Path, ssd: Path, log: Path) -> Served:
    argv = [
        *(sys.executable, "-m", "prefixcache", "serve", "--model", str(model)),
        *("--ssd-dir", str(ssd), "--hot-max-bytes", str(2 * MiB)),
        *("--ssd-max-bytes", str(16 * MiB), "--block-size", "16"),
    ]
    server = Served(argv, log, free_port())
    server.wait_ready()
    return server


def cli(*args: str) -> dict:
    """A ``prefixcache`` command's JSON (exit status 1 with a JSON verdict: kept)."""
    done = subprocess.run(
        [sys.executable, "-m", "prefixcache", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        return json.loads(done.stdout)
    except ValueError:
        message = f"prefixcache {args[0]} exited {done.returncode}: {done.stderr}"
        raise RuntimeError(message) from None


def sample(server: Served, ssd: Path, began: float, clients: Clients) -> dict:
    from .common import on_disk_now

    m = metrics(server)
    ttfts, share = clients.take()
    return {
        "seconds": time.perf_counter() - began,
        "requests": clients.ops,
        "rss": rss(str(server.proc.pid)),
        "ram_hot": m.get("ram_hot_bytes", 0),
        "ram_queued": m.get("ram_queued_bytes", 0),
        "ram_loading": m.get("ram_loading_bytes", 0),
        "ram_total": m.get("ram_bytes", 0),
        "ram_max": m.get("ram_max_bytes", 0),
        "queue_depth": m.get("ssd_write_queue_blocks", 0),
        "ssd_on_disk": on_disk_now(str(ssd)),
        "blocks_written": m.get("ssd_writes_total", 0),
        "dropped_writes": m.get("ssd_dropped_writes_total", 0),
        "hit_share": share,
        "ttft_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
    }


def kill_and_restart(
    server: Served, model: Path, ssd: Path, tmp: Path, chats: Chats, tally: Tally
) -> tuple[Served, str]:
    """Drain, list, probe, SIGKILL, restart; the findings go to ``tally``."""
    deadline = time.monotonic() + 300
    while metrics(server).get("ssd_write_queue_blocks", 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    probes = [chats.next() for _ in range(PROBES)]
    before = [server.chat(p, 4).text for p in probes]
    listed = {row["key"] for row in cli("ls", "--ssd-dir", str(ssd))["rows"]}
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    server = start(model, ssd, tmp / "server-2.log")
    found = {row["key"] for row in cli("ls", "--ssd-dir", str(ssd))["rows"]}
    lost = listed - found
    verified = cli("verify", "--ssd-dir", str(ssd), "--no-progress")
    replies = [server.chat(p, 4) for p in probes]
    after = [r.text for r in replies]
    wrong = sum(a != b for a, b in zip(before, after, strict=True))
    # unreachable blocks are reported, no error: a write of an upper block that the
    # full queue dropped (counted) leaves its subtree detached
    if lost or verified["num_bad"] or verified["num_unreadable"]:
        tally.errors += 1
        bad = {k: v for k, v in verified.items() if k.startswith("num_") or k == "ok"}
        tally.findings.append(f"after kill -9: {len(lost)} written blocks lost, verify {bad}")
    if wrong:
        tally.wrong += wrong
        tally.findings.append(f"after kill -9: {wrong} of {PROBES} probes answered differently")
    tally.checked += PROBES
    note = (
        f"kill -9: {len(listed)} blocks indexed before, {len(listed & found)} found after, "
        f"{verified['num_bad']} bad, {verified['num_unreadable']} unreadable, "
        f"{verified['num_unreachable']} unreachable from a root, probes {PROBES - wrong}/"
        f"{PROBES} the same, {sum(r.cached_tokens for r in replies)} of "
        f"{sum(r.prompt_tokens for r in replies)} of their prompt tokens cached"
    )
    return server, note


def drive(
    clients: Clients,
    setup: SustainedSetup,
    model: Path,
    ssd: Path,
    tmp: Path,
    rows: list[dict],
    tally: Tally,
    began: float,
) -> str:
    """The clients' run, sampled, with the kill and restart halfway; the kill's note."""
    threads = [threading.Thread(target=clients.run, daemon=True) for _ in range(4)]
    clients.go.set()
    for t in threads:
        t.start()
    end = time.monotonic() + 60 * setup.minutes
    killed, note = False, "no kill"
    while time.monotonic() < end:
        time.sleep(setup.every)
        rows.append(sample(clients.server, ssd, began, clients))
        if not killed and time.monotonic() > end - 30 * setup.minutes:
            clients.pause()
            clients.server, note = kill_and_restart(
                clients.server, model, ssd, tmp, clients.chats, tally
            )
            killed = True
            clients.go.set()
    clients.stop.set()
    clients.go.set()
    for t in threads:
        t.join(timeout=600)
    return note


def run(setup: SustainedSetup, base_dir: str | None = None) -> Result:
    from prefixcache.tiny.models import save_model

    began = time.perf_counter()
    tally, rows = Tally(), []
    clients = Clients(Chats(setup.seed), setup.rate)
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-sustained-serve-") as name:
        tmp = Path(name)
        model, ssd = save_model(tmp / "model", "llama"), tmp / "ssd"
        clients.server = start(model, ssd, tmp / "server-1.log")
        try:
            note = drive(clients, setup, model, ssd, tmp, rows, tally, began)
        finally:  # whatever failed, no server is left running
            clients.stop.set()
            clients.go.set()
            clients.server.stop()
    tally.ops, tally.errors = clients.ops, tally.errors + clients.errors
    check_growth(rows, setup, tally)
    mode = f"{setup.rate:g}/s" if setup.rate else "back to back"
    path = write(rows, COLUMNS, f"{setup.out}-serve-{mode.replace('/', 'per').replace(' ', '-')}")
    notes = f"serve, 4 clients {mode}, {clients.ops} requests; {summary(rows)}"
    return tally.result("sustained serve", began, f"{notes}; {note}; {path}")
