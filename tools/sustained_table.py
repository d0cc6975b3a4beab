"""RAM and the SSD writer under back-to-back requests: the sustained-traffic table.

The README's loop (fetch, prefill the rest, store) on the tiny llama, block
16, a 2 MiB hot budget and a 16 MiB SSD cap, every other setting at its
default; 4 system prompts, random user turns (soaklib/sustained.py), requests
back to back, every 25th compared with the live run (bit-identical logits).
One run per configuration and request count:

- ``write_back``: the defaults (a block reaches the SSD when hot evicts it);
- ``write_through``: every block is queued for the SSD as it is stored;
- ``remote``: ``write_back`` plus a remote tier on a real redis-server that
  this tool starts and stops (every block queued for it as it is stored);
- ``slow_ssd``: ``write_back`` on a disk that writes ``--slow-blocks-per-s``
  blocks a second (the writer waits that long per block before each batch),
  slower than hot evicts: the queue must stop at its bound and what does not
  fit is dropped and counted (``queue_full=drop``, the default).

Per run: MLX active memory and RSS at the end and their growth after warm-up
(from the first sample past a tenth of the run), the cache's RAM at most
against its bound (``stats()["ram"]``), each writer's queue at most, the
blocks spilled from hot and queued (``num_spills``: a spill the full queue
dropped is not among them) against those the SSD tier wrote and dropped
(queue full, counted), and the remote tier's writes and drops. Exit status 1 if a
restore was wrong, the RAM passed its bound, or MLX active memory grew more
than 12 MiB or RSS more than 48 MiB after warm-up.

    python tools/sustained_table.py --requests 3000 30000
    python tools/sustained_table.py --requests 3000 --configs write_back slow_ssd
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import mlx.core as mx
from soaklib import common
from soaklib.sustained import Prompts, rss, serve_one

from prefixcache import PrefixCache
from prefixcache.tiers.ssd.tier import SsdTier
from prefixcache.tiny.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer  # the tests' server launcher

MiB = 1 << 20
CONFIGS = ("write_back", "write_through", "remote", "slow_ssd")
MLX_BOUND, RSS_BOUND = 12 * MiB, 48 * MiB


class SlowSsd(SsdTier):
    """An SSD tier on a disk that writes ``blocks_per_s`` blocks a second."""

    def __init__(self, config, blocks_per_s: float) -> None:
        self.seconds_per_block = 1.0 / blocks_per_s
        super().__init__(config)

    def _write_batch(self, items) -> None:
        time.sleep(self.seconds_per_block * len(items))  # the disk's pace, on the writer
        super()._write_batch(items)


@dataclass(slots=True)
class Run:
    """One configuration's samples and counts."""

    config: str
    requests: int
    samples: list[dict[str, int]] = field(default_factory=list)
    seconds: float = 0.0
    checked: int = 0
    wrong: int = 0
    stats: dict = field(default_factory=dict)

    def growth(self, column: str) -> int:
        warm = self.samples[len(self.samples) // 10 :]
        return max(s[column] for s in warm) - warm[0][column]

    def peak(self, column: str) -> int:
        return max(s[column] for s in self.samples)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[3000])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--samples", type=int, default=30, help="samples per run")
    p.add_argument("--slow-blocks-per-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the temp directories go")
    return p


def open_cache(model, name: str, tmp: str, redis_url: str | None, slow: float) -> PrefixCache:
    cfg = common.config(tmp, hot_max_bytes=2 * MiB, ssd_max_bytes=16 * MiB)
    cfg = cfg.replace(restore_headroom=256, ssd_min_free_bytes=1 << 30)  # the defaults
    if name == "write_through":
        cfg = cfg.replace(write_policy="write_through")
    if name == "remote":
        cfg = cfg.replace(remote_url=redis_url)
    if name == "slow_ssd":
        return PrefixCache(model, cfg, model_id=common.MODEL_ID, tiers=[SlowSsd(cfg, slow)])
    return PrefixCache(model, cfg, model_id=common.MODEL_ID)


def sample(pc: PrefixCache) -> dict[str, int]:
    st = pc.stats()
    ram = st["ram"]
    return {
        "rss": rss(),
        "mlx_active": mx.get_active_memory(),
        "ram": ram["nbytes"],
        "ram_max": ram["max_bytes"],
        "loading": ram["loading_bytes"],
        "ssd_queue": st["ssd"]["queue_bytes"],
        "ssd_queue_blocks": st["ssd"]["queue_depth"],
        "remote_queue": st["remote"]["queue_bytes"] if "remote" in st else 0,
    }


def run_one(model, name: str, num: int, args, redis_url: str | None) -> Run:
    run = Run(name, num)
    prompts = Prompts(args.seed)
    every = max(1, num // args.samples)
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="sustained-table-") as tmp,
        open_cache(model, name, tmp, redis_url, args.slow_blocks_per_s) as pc,
    ):
        for k in range(1, num + 1):
            _, n, ok = serve_one(pc, model, prompts.next(), k % 25 == 0)
            run.checked += ok is not None and n > 0
            run.wrong += ok is False
            if k % every == 0:
                run.samples.append(sample(pc))
                progress(run, k, time.perf_counter() - start)
        run.seconds = time.perf_counter() - start
        run.stats = pc.stats()
    return run


def progress(r: Run, k: int, seconds: float) -> None:
    """One line per sample on stderr: what a run cut short still shows."""
    s = r.samples[-1]
    print(
        f"  {r.config} {k}/{r.requests} in {seconds:.0f} s: MLX {s['mlx_active'] / MiB:.1f} "
        f"MiB, RSS {s['rss'] / MiB:.1f} MiB, RAM {s['ram'] / MiB:.2f} MiB, SSD queue "
        f"{s['ssd_queue'] / MiB:.2f} MiB, remote queue {s['remote_queue'] / MiB:.2f} MiB",
        file=sys.stderr,
        flush=True,
    )


def row(r: Run) -> str:
    st, ssd = r.stats, r.stats["ssd"]
    remote = st.get("remote")
    far = f"{remote['num_writes']} / {remote['num_dropped_writes']}" if remote else "-"
    return (
        f"| {r.config} | {r.requests:,} | {r.requests / r.seconds:.0f} | "
        f"{r.samples[-1]['mlx_active'] / MiB:.1f} | {r.growth('mlx_active') / MiB:+.1f} | "
        f"{r.growth('rss') / MiB:+.1f} | {r.peak('ram') / MiB:.2f} / "
        f"{r.samples[-1]['ram_max'] / MiB:.0f} | {r.peak('ssd_queue') / MiB:.2f} "
        f"({r.peak('ssd_queue_blocks')}) | {st['num_spills']:,} | {ssd['num_writes']:,} | "
        f"{ssd['num_dropped_writes']:,} | {far} | {r.peak('remote_queue') / MiB:.2f} | "
        f"{r.peak('loading') / MiB:.2f} | {r.checked} / {r.wrong} |"
    )


HEADER = (
    "| config | requests | req/s | MLX active MiB | MLX growth | RSS growth | RAM max / bound "
    "MiB | SSD queue max MiB (blocks) | spills queued | SSD written | SSD dropped | "
    "remote written / dropped | remote queue max MiB | loading max MiB | checked / wrong |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def failures(r: Run) -> list[str]:
    out = []
    if r.wrong:
        out.append(f"{r.wrong} wrong restores")
    if any(s["ram"] > s["ram_max"] for s in r.samples):
        out.append("RAM over its bound")
    if r.growth("mlx_active") > MLX_BOUND:
        out.append(f"MLX active memory grew {r.growth('mlx_active') / MiB:.1f} MiB")
    if r.growth("rss") > RSS_BOUND:
        out.append(f"RSS grew {r.growth('rss') / MiB:.1f} MiB")
    return out


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    model = build_model("llama")
    runs, bad = [], []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sustained-redis-") as work:
        server = RedisServer(work) if "remote" in args.configs else None
        try:
            for num in args.requests:
                for name in args.configs:
                    r = run_one(model, name, num, args, server and server.url)
                    runs.append(r)
                    bad += [f"{name} x {num}: {f}" for f in failures(r)]
                    print(f"{name} x {num}: {r.seconds:.0f} s; {row(r)}", flush=True)
                    if server is not None:
                        server.client().flushall()
        finally:
            if server is not None:
                server.stop()
    print(f"\nload average {os.getloadavg()[0]:.1f}\n\n{HEADER}")
    for r in runs:
        print(row(r))
    for line in bad:
        print(f"FAILED: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
