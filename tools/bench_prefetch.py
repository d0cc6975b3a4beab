"""Prefetch while a request waits: time to first token of concurrent requests whose
cached prefixes live only on a lower tier, with and without ``prefetch``.

A small random-weight llama with a wide K/V (``--kv-heads`` x ``--head-dim``, so a
prefix is many bytes to restore: the restore is a real share of the wait) is
saved to a directory and served by real ``prefixcache serve`` processes:

1. fill: one server answers each of ``--clients`` conversations once (a system
   prompt of ``--prefix-words`` words each, its own), then stops (SIGTERM
   flushes its hot tier to the lower tier);
2. rounds: a fresh server (hot tier empty) takes one new turn of every
   conversation at once (``--clients`` threads, streamed: time to first token),
   then stops (the SSD tier's files are dropped from the page cache before
   each round); rounds alternate prefetch on (the default) and off
   (``PREFIXCACHE_PREFETCH_BYTES=0``), ``--rounds`` of each, which goes first
   alternating too. ``--path
   sequential`` sends the requests with a ``seed`` (mlx-lm's sequential path:
   each waits for the generation before it, the case prefetch is for);
   ``batched`` lets mlx-lm's batch take them (it fetches each as it arrives, so
   they hardly wait);
3. idle: the same turns one at a time (nothing queued), prefetch on and off.

``--tier ssd`` keeps the prefixes on the SSD tier; ``--tier remote`` on a Redis
server the tool starts (``--hot-cache-only``: hot and remote only). Prints the
TTFT median and p90 of each mode, their ratios, and the blocks each mode's
servers prefetched (their ``/metrics``: with nothing queued there should be
none; ``idle on`` and ``idle off`` then run the same code).

    python tools/bench_prefetch.py --tier ssd
    python tools/bench_prefetch.py --tier remote
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchlib import drop_caches
from reuselib.servers import Server, free_port

from prefixcache.tiny.models import save_model

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tier", choices=("ssd", "remote"), default="ssd")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--path", choices=("sequential", "batched"), default="sequential")
    p.add_argument("--max-tokens", type=int, default=4, help="generated per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    p.add_argument("--prefix-words", type=int, default=250, help="about 1,000 tokens")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def serve(args, model: Path, work: Path, prefetch: bool, redis_url: str | None) -> Server:
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
    argv += ["--block-size", str(args.block_size), "--warm-bytes", "0"]
    if redis_url is None:
        argv += ["--ssd-dir", str(work / "ssd")]
    else:
        argv += ["--hot-cache-only", "--remote-url", redis_url]
    env = {"PREFIXCACHE_PREFETCH_BYTES": "256M" if prefetch else "0"}
    metrics = free_port()
    server = Server("ours", [*argv, "--metrics-port", str(metrics)], work / "server.log", env=env)
    server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    server.wait_ready()
    return server


def prefetched(server: Server) -> int:
    """Blocks the server's prefetch has promoted so far (its Prometheus counter)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("prefixcache_prefetched_blocks_total "):
                return int(float(line.split()[1]))
    return 0


def concurrent(server: Server, requests: list[list[dict[str, str]]], **body) -> list[float]:
    """Time to first token of every request, all sent at once (a barrier)."""
    out: list[float] = [0.0] * len(requests)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        try:
            barrier.wait()
            out[i] = server.first_token(requests[i], **body)
        except BaseException as err:  # re-raised on the main thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main() -> None:
    args = setup_arg_parser().parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wide = {
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.kv_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
        }
        model = save_model(work / "model", "llama", **wide)
        redis = _redis(work) if args.tier == "remote" else None
        url = None if redis is None else redis[1]
        try:
            history = [
                [{"role": "system", "content": text(rng, args.prefix_words)}]
                for _ in range(args.clients)
            ]
            server = serve(args, model, work, True, url)  # fill: one turn each
            for h in history:
                h.append({"role": "user", "content": text(rng, 8)})
                server.first_token(h)
            server.stop()
            results, blocks = _rounds(args, rng, model, work, url, history)
        finally:
            if redis is not None:
                redis[0].terminate()
                redis[0].wait(timeout=10)
    _report(args, results, blocks)


MODES = ("on", "off", "idle on", "idle off")


def _rounds(args, rng, model, work, url, history) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each mode's times to first token, and the blocks its servers prefetched."""
    results: dict[str, list[float]] = {m: [] for m in MODES}
    blocks = dict.fromkeys(MODES, 0)
    for r in range(args.rounds):
        for prefetch in (True, False) if r % 2 == 0 else (False, True):  # order alternates
            turns = [[*h, {"role": "user", "content": text(rng, 8)}] for h in history]
            body = {"max_tokens": args.max_tokens}
            if args.path == "sequential":
                body["seed"] = 0
            _cold(work, url)
            server = serve(args, model, work, prefetch, url)
            results["on" if prefetch else "off"] += concurrent(server, turns, **body)
            blocks["on" if prefetch else "off"] += prefetched(server)
            server.stop()
            _cold(work, url)
            server = serve(args, model, work, prefetch, url)
            mode = "idle on" if prefetch else "idle off"
            results[mode] += [server.first_token(t, **body) for t in turns]  # nothing queued
            blocks[mode] += prefetched(server)
            server.stop()
    return results, blocks


def _cold(work: Path, redis_url: str | None) -> None:
    """The SSD tier's files out of the page cache (as after a reboot; root drops it all)."""
    if redis_url is None:
        paths = [str(p) for p in (work / "ssd").rglob("*") if p.is_file()]
        drop_caches(paths, level=1)


def _redis(work: Path) -> tuple[subprocess.Popen, str]:
    sock = work / "redis.sock"
    argv = ["redis-server", "--port", "0", "--unixsocket", str(sock)]
    proc = subprocess.Popen([*argv, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return proc, f"unix://{sock}"


def _report(args, results: dict[str, list[float]], blocks: dict[str, int]) -> None:
    rows = []
    for mode, times in results.items():
        p50 = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
        rows.append((mode, len(times), p50, p90))
        line = f"TTFT p50 {p50 * 1e3:.0f} ms p90 {p90 * 1e3:.0f} ms"
        print(f"{args.tier} prefetch {mode}: n={len(times)} {line}", flush=True)
    by = {m: (p50, p90) for m, _, p50, p90 in rows}
    where = f"prefixes on {args.tier}, {args.path} path"
    print(f"\n{args.clients} concurrent clients, {where}, load {os.getloadavg()}")
    print("| mode | requests | TTFT p50 ms | TTFT p90 ms | blocks prefetched |")
    print("|---|---|---|---|---|")
    for mode, n, p50, p90 in rows:
        print(f"| {mode} | {n} | {p50 * 1e3:.0f} | {p90 * 1e3:.0f} | {blocks[mode]} |")
    on, off, ion, ioff = by["on"], by["off"], by["idle on"], by["idle off"]
    print(f"\nconcurrent: prefetch / none p50 {on[0] / off[0]:.2f}, p90 {on[1] / off[1]:.2f}")
    print(f"idle: prefetch / none p50 {ion[0] / ioff[0]:.2f}, p90 {ion[1] / ioff[1]:.2f}")


if __name__ == "__main__":
    main()
