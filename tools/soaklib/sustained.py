"""Scenario sustained (library): the README's loop under a steady stream, sampled in time.

Requests go back to back (``rate`` 0) or at a fixed rate (requests per second)
for ``minutes``: 4 system prompts, random user turns, the tiny llama, block 16,
a small hot budget and SSD cap (every other setting at its default, the quiet
window included). Every ``every`` seconds a sample: RSS, MLX active memory,
the cache's RAM by part (``stats()["ram"]``), the SSD writer's queue, bytes on
disk, blocks written and dropped, the hit share and median time to first
logits (fetch + prefill of the rest) since the last sample. Every 25th request
is checked against the live run (bit-identical logits). From the first sample
after warm-up (a tenth of the run) on, RSS may grow at most 48 MiB and MLX
active memory 12 MiB; the bytes on disk never pass the cap. Samples go to a
CSV and a PNG (sustained_plot.py).

The memory scenario (memory.py) missed the starving writer: its bound on MLX
memory subtracted the hot tier and allowed 4 MiB, but it sampled only every
500 requests after a ``gc.collect()``, with a 2 MiB SSD cap that the writer's
first urgent batch filled, and never looked at the queue or at what reached
the disk; a test-sized 1 MiB hot tier spilled too little for the queue to
grow past its bounds in 10,000 requests.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import common
from .common import BLOCK, MODEL_ID, Result, Tally, prefill

MiB = 1 << 20
COLUMNS = (
    "seconds",
    "requests",
    "rss",
    "mlx_active",
    "ram_hot",
    "ram_queued",
    "ram_loading",
    "ram_total",
    "ram_max",
    "queue_depth",
    "ssd_on_disk",
    "blocks_written",
    "dropped_writes",
    "hit_share",
    "ttft_ms",
)


@dataclass(frozen=True, slots=True)
class SustainedSetup:
    minutes: float = 10.0
    every: float = 5.0  # seconds between samples
    rate: float = 0.0  # requests per second; 0: back to back
    hot_bytes: int = 2 * MiB
    ssd_bytes: int = 16 * MiB
    seed: int = 0
    check_every: int = 25  # requests between exactness checks
    rss_bound: int = 48 * MiB
    mlx_bound: int = 12 * MiB
    out: str = "sustained"  # path prefix of the CSV and PNG


def rss(pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Prompts:
    """4 system prompts of 4 blocks, user turns of 8-80 random tokens."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.systems = [common.tokens(seed * 100 + s, 4 * BLOCK) for s in range(4)]

    def next(self) -> list[int]:
        user = [self.rng.randrange(common.VOCAB) for _ in range(self.rng.randrange(8, 80))]
        return self.systems[self.rng.randrange(4)] + user


def growth(rows: list[dict[str, float]], column: str) -> float:
    """Largest rise of ``column`` over its value at the first sample after warm-up."""
    warm = len(rows) // 10
    if len(rows) <= warm or column not in rows[0]:
        return 0.0  # no sample, or not sampled in this mode (MLX memory of a server)
    return max(r[column] for r in rows[warm:]) - rows[warm][column]


def serve_one(pc, model, tokens: list[int], check: bool) -> tuple[float, int, bool | None]:
    """Fetch, prefill the rest, store; (seconds to the first logits, cached, exact
    or None when not compared)."""
    start = time.perf_counter()
    cache, n = pc.fetch(tokens)
    logits = prefill(model, tokens[n:], cache)
    seconds = time.perf_counter() - start
    pc.store(tokens, cache)
    if not check or n % common.STEP:  # chunks the live run cannot share: not compared
        return seconds, n, None
    live = prefill(model, tokens, make_prompt_cache(model))
    return seconds, n, bool(mx.array_equal(logits, live).item())


def run(setup: SustainedSetup, base_dir: str | None = None) -> Result:
    from prefixcache.tiny.models import build_model

    from .sustained_plot import write

    start = time.perf_counter()
    tally, rows = Tally(), []
    model = build_model("llama")
    prompts = Prompts(setup.seed)
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-sustained-") as tmp:
        cfg = common.config(tmp, hot_max_bytes=setup.hot_bytes, ssd_max_bytes=setup.ssd_bytes)
        cfg = cfg.replace(restore_headroom=256, ssd_min_free_bytes=1 << 30)  # the defaults
        with common.PrefixCache(model, cfg, model_id=MODEL_ID) as pc:
            end = time.monotonic() + 60 * setup.minutes
            next_sample = time.monotonic() + setup.every
            ttfts, prompt_tokens, cached, k = [], 0, 0, 0
            while (now := time.monotonic()) < end:
                if setup.rate > 0:
                    time.sleep(max(0.0, start + k / setup.rate - time.perf_counter()))
                tokens = prompts.next()
                k += 1
                seconds, n, ok = serve_one(pc, model, tokens, k % setup.check_every == 0)
                tally.ops += 1
                tally.checked += ok is not None and n > 0
                if ok is False:
                    tally.wrong += 1
                    tally.findings.append(f"request {k}: wrong logits after {n} cached tokens")
                ttfts.append(seconds)
                prompt_tokens, cached = prompt_tokens + len(tokens), cached + n
                if now >= next_sample:
                    rows.append(sample(pc, tmp, start, k, ttfts, cached / prompt_tokens))
                    ttfts, prompt_tokens, cached = [], 0, 0
                    next_sample += setup.every
                    if rows[-1]["ssd_on_disk"] > setup.ssd_bytes:
                        tally.errors += 1
                        tally.findings.append(f"on disk over the cap: {rows[-1]}")
    check_growth(rows, setup, tally)
    mode = f"{setup.rate:g}/s" if setup.rate else "back to back"
    path = write(rows, COLUMNS, f"{setup.out}-library-{mode.replace('/', 'per').replace(' ', '-')}")
    notes = f"library, {mode}, {tally.ops} requests; {summary(rows)}; {path}"
    return tally.result("sustained", start, notes)


def sample(pc, ssd_dir: str, start: float, k: int, ttfts: list[float], hits: float) -> dict:
    stats = pc.stats()
    ram, ssd = stats["ram"], stats["ssd"]
    return {
        "seconds": time.perf_counter() - start,
        "requests": k,
        "rss": rss(),
        "mlx_active": mx.get_active_memory(),
        "ram_hot": ram["hot_bytes"],
        "ram_queued": ram["queued_bytes"],
        "ram_loading": ram["loading_bytes"],
        "ram_total": ram["nbytes"],
        "ram_max": ram["max_bytes"],
        "queue_depth": ssd["queue_depth"],
        "ssd_on_disk": common.on_disk_now(ssd_dir),
        "blocks_written": ssd["num_writes"],
        "dropped_writes": ssd["num_dropped_writes"],
        "hit_share": hits,
        "ttft_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
    }


def check_growth(rows: list[dict], setup: SustainedSetup, tally: Tally) -> None:
    for column, bound in (("rss", setup.rss_bound), ("mlx_active", setup.mlx_bound)):
        if (grew := growth(rows, column)) > bound:
            tally.errors += 1
            tally.findings.append(f"{column} grew {grew / MiB:.1f} MiB > {bound / MiB:.0f}")
    for row in rows:
        if row["ram_total"] > row["ram_max"]:
            tally.errors += 1
            tally.findings.append(f"RAM over its bound: {row}")


def summary(rows: list[dict]) -> str:
    if not rows:
        return "no sample"
    last = rows[-1]
    return (
        f"{len(rows)} samples: RSS growth after warm-up {growth(rows, 'rss') / MiB:+.1f} MiB, "
        f"MLX active {growth(rows, 'mlx_active') / MiB:+.1f} MiB, queue max "
        f"{max(r['ram_queued'] for r in rows) / MiB:.2f} MiB, written {last['blocks_written']}, "
        f"dropped {last['dropped_writes']}, max on disk "
        f"{max(r['ssd_on_disk'] for r in rows) / MiB:.1f} MiB"
    )
