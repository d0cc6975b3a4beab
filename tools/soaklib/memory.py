"""Scenario memory: RSS and MLX active memory stay flat over many requests.

For a KV model (the tiny llama) and a hybrid one (qwen3_next: gated delta net
+ attention), hot-only and tiered (small SSD budget), ``requests`` requests
are served with ``pc.prefill`` (fetch, block-aligned prefill, capture, store):
a shared system prefix plus one of ``pool`` suffixes, so there are hits,
misses and evictions all along. Memory is sampled every ``every`` requests
after ``gc.collect()``. The growth from the first sample after warm-up (10%
of the requests) to the largest later one must stay within the bounds; MLX
memory is counted without the hot tier (bounded by its own budget).
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from dataclasses import dataclass

import mlx.core as mx

from .common import BLOCK, MODEL_ID, Result, Tally, config, tokens

MiB = 1 << 20
ARCHS = ("llama", "qwen3_next")


@dataclass(frozen=True, slots=True)
class MemorySetup:
    requests: int = 10_000
    every: int = 500
    pool: int = 300
    seed: int = 0
    hot_bytes: int = 1 << 20
    ssd_bytes: int = 2 << 20
    rss_bound: int = 24 * MiB
    mlx_bound: int = 4 * MiB


@dataclass(frozen=True, slots=True)
class Curve:
    name: str
    rss: tuple[int, ...]
    mlx: tuple[int, ...]  # active memory minus the hot tier's bytes
    hot_max: int

    def growth(self) -> tuple[int, int]:
        warm = max(1, len(self.rss) // 10)
        return max(self.rss[warm:]) - self.rss[warm], max(self.mlx[warm:]) - self.mlx[warm]


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def curve(arch: str, ssd_dir: str | None, setup: MemorySetup) -> Curve:
    from prefixcache import PrefixCache
    from prefixcache.tiny.models import build_model

    model = build_model(arch)
    cfg = config(ssd_dir, hot_max_bytes=setup.hot_bytes, ssd_max_bytes=setup.ssd_bytes)
    rng = random.Random(setup.seed)
    system = tokens(7, 2 * BLOCK)
    rss_s, mlx_s, hot_max = [], [], 0
    with PrefixCache(model, cfg, model_id=MODEL_ID + arch) as pc:
        for k in range(1, setup.requests + 1):
            suffix = rng.randrange(setup.pool)
            prompt = system + tokens(1000 + suffix, 8 + suffix % 40)
            cache, logits = pc.prefill(prompt, prefill_step_size=BLOCK)
            del cache, logits
            if k % setup.every == 0:
                gc.collect()
                hot = pc.stats()["hot"]["nbytes"]
                hot_max = max(hot_max, hot)
                rss_s.append(rss())
                mlx_s.append(mx.get_active_memory() - hot)
    name = f"{arch} {'tiered' if ssd_dir else 'hot-only'}"
    return Curve(name, tuple(rss_s), tuple(mlx_s), hot_max)


def run(setup: MemorySetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    tally = Tally()
    lines = []
    for arch in ARCHS:
        for tiered in (False, True):
            with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-mem-") as tmp:
                c = curve(arch, tmp if tiered else None, setup)
            tally.ops += setup.requests
            d_rss, d_mlx = c.growth()
            lines.append(
                f"{c.name}: RSS {c.rss[0] / MiB:.0f}->{c.rss[-1] / MiB:.0f} MiB "
                f"(growth after warm-up {d_rss / MiB:+.1f}), MLX non-hot growth "
                f"{d_mlx / MiB:+.2f} MiB, hot max {c.hot_max / MiB:.2f} MiB"
            )
            over = (d_rss > setup.rss_bound, d_mlx > setup.mlx_bound, c.hot_max > setup.hot_bytes)
            if any(over):
                tally.errors += 1
                tally.findings.append(f"{c.name} grew beyond its bound: {lines[-1]}")
    bounds = (
        f"bounds: RSS growth <= {setup.rss_bound / MiB:.0f} MiB, MLX non-hot growth <= "
        f"{setup.mlx_bound / MiB:.0f} MiB, hot <= {setup.hot_bytes / MiB:.0f} MiB; "
        f"{setup.requests} requests each, sampled every {setup.every}"
    )
    return tally.result("memory", start, bounds + "; " + "; ".join(lines))
