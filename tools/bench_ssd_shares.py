"""What the SSD tier's tenant shares cost per block written: no shares, floors, a cap.

The SSD tier alone (a directory under ``--dir``, /dev/shm by default: no
disk in the timing, only the tier's own work) takes ``--puts`` small blocks
in chains of 4 from three tenants, a budget of 256 blocks, so nearly every
write evicts; written inline in batches of 16. Three systems, alternated
``--repeats`` times (3; ``--puts`` 2000):

  no shares   the index keeps the tenants' records (it always does), eviction by LRU
  floors      b and c each a floor of a quarter of the budget: each eviction
              reads every tenant's record and takes the most over its floor's leaf
  A capped    a capped at a quarter of the budget: its writes evict its own leaves

Medians of the process's CPU seconds per block written and their ratio to
"no shares" (CPU time: other processes on the machine stretch the wall clock,
less the CPU time; compare only within one run).

    python tools/bench_ssd_shares.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import tempfile
import time

import mlx.core as mx

from prefixcache.blocks import Block
from prefixcache.config import CacheConfig
from prefixcache.tiers.ssd.tier import SsdTier

ROOT = b"r" * 16


def chains(num: int, seed: int) -> list[Block]:
    """``num`` blocks in chains of 4, the tenants a, b, c in turn (a twice as often)."""
    rng = random.Random(seed)
    data = {"0.keys": mx.arange(256, dtype=mx.float32)}
    mx.eval(data)
    out: list[Block] = []
    for i in range(num // 4):
        tenant = "aabc"[i % 4]
        parent = ROOT
        for j in range(4):
            key = rng.randbytes(16)
            out.append(Block.make(key, parent, ROOT, j, b"", data, tenant))
            parent = key
    return out


def seconds(blocks: list[Block], config: CacheConfig) -> tuple[float, dict]:
    """CPU seconds to write ``blocks`` into a fresh tier, and its tenants' figures."""
    tier = SsdTier(config)
    try:
        began = time.process_time()
        for start in range(0, len(blocks), 16):
            for block in blocks[start : start + 16]:
                tier.put(block)
            tier.flush()
        spent = time.process_time() - began
        return spent, tier.tenant_stats()
    finally:
        tier.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--puts", type=int, default=2000, help="blocks written per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = p.parse_args()
    blocks = chains(args.puts, 0)
    probe = tempfile.mkdtemp(dir=args.dir)
    with SsdTier(CacheConfig(ssd_dir=probe, ssd_min_free_bytes=0)) as tier:
        tier.put(blocks[0])
        tier.flush()
        file_bytes = tier.stats()["nbytes"]
    budget = 256 * file_bytes
    quarter = budget // 4
    systems = {
        "no shares": {},
        "floors": {"ssd_tenant_floors": f"b={quarter},c={quarter}"},
        "A capped": {"ssd_tenant_caps": f"a={quarter}"},
    }
    timed: dict[str, list[float]] = {name: [] for name in systems}
    held: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, shares in systems.items():
            with tempfile.TemporaryDirectory(dir=args.dir) as path:
                config = CacheConfig(ssd_dir=path, ssd_max_bytes=budget, ssd_min_free_bytes=0)
                config = dataclasses.replace(config, queue_full="inline", **shares)
                spent, held[name] = seconds(blocks, config)
            timed[name].append(spent)
    base = statistics.median(timed["no shares"])
    print(f"{args.puts} blocks of {file_bytes} B, budget 256 blocks, median of {args.repeats}")
    for name, values in timed.items():
        per = statistics.median(values) / args.puts * 1e6
        blocks_of = {t: f["num_blocks"] for t, f in held[name].items()}
        print(
            f"{name:10} {per:8.1f} us per block  ratio {statistics.median(values) / base:.3f}"
            f"  held {blocks_of}"
        )


if __name__ == "__main__":
    main()
