"""What a background thread costs a prefill on this machine.

The same prefill (3 steps of 16 tokens on a 664-token cache of bench_serve's
model) timed alone and beside one thread doing, in a loop, what the cache's
background work does: write and fsync a 64 KiB file (the SSD writer's
payloads), commit a small LMDB transaction (its index), hash 64 KiB and run
Python (anything holding the GIL), or sleep (the control: a thread that only
wakes). Medians of ``--repeat`` prefills each, in the order given, "alone"
first and last. Why the SSD writer and promotions wait out a fetch's quiet
window (prefixcache/tiers/quiet.py, tools/bench_quiet.py).

    python tools/bench_contention.py
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import lmdb
import mlx.core as mx
import numpy as np
import xxhash
from bench_serve import bench_model, setup_arg_parser
from mlx_lm.models.cache import make_prompt_cache

DATA = np.random.default_rng(0).bytes(64 << 10)


def background(directory: str) -> dict[str, Callable[[threading.Event], None] | None]:
    env = lmdb.open(os.path.join(directory, "index"), map_size=1 << 30)

    def fsync_files(stop: threading.Event) -> None:
        for i in range(1 << 62):
            if stop.is_set():
                return
            path = os.path.join(directory, f"f{i % 50}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, DATA)
                os.fsync(fd)
            finally:
                os.close(fd)

    def lmdb_commits(stop: threading.Event) -> None:
        for i in range(1 << 62):
            if stop.is_set():
                return
            with env.begin(write=True) as txn:
                txn.put(str(i).encode(), DATA[:200])

    def python(stop: threading.Event) -> None:
        while not stop.is_set():
            xxhash.xxh3_64(DATA).intdigest()
            sum(range(2000))

    def sleep(stop: threading.Event) -> None:
        while not stop.is_set():
            time.sleep(0.001)

    return {
        "alone": None,
        "fsync 64 KiB files": fsync_files,
        "LMDB commits": lmdb_commits,
        "Python (GIL)": python,
        "sleep 1 ms (control)": sleep,
        "alone again": None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeat", type=int, default=40)
    args = p.parse_args()
    model = bench_model(setup_arg_parser().parse_args([]))
    rng = random.Random(1)
    history = [rng.randrange(1, 500) for _ in range(664)]
    base = make_prompt_cache(model)
    model(mx.array([history]), cache=base)
    mx.eval([c.state for c in base])

    def prefill() -> float:
        cache = copy.deepcopy(base)
        start = time.perf_counter()
        for _ in range(3):
            mx.eval(model(mx.array([[rng.randrange(1, 500) for _ in range(16)]]), cache=cache))
        return time.perf_counter() - start

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, work in background(tmp).items():
            stop = threading.Event()
            thread = threading.Thread(target=work, args=(stop,)) if work else None
            if thread:
                thread.start()
            times = [prefill() for _ in range(args.repeat)]
            stop.set()
            if thread:
                thread.join()
            rows.append((name, statistics.median(times)))
    alone = statistics.mean([t for name, t in rows if name.startswith("alone")])
    print(f"| beside | prefill ms (median of {args.repeat}) | / alone |")
    print("|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.1f} | {t / alone:.2f} |")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
