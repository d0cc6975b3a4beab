"""How many SSD payload files a prefilled chain takes: run files against one per block.

Each tiny model (random weights, ``prefixcache/tiny``) prefills one prompt through
``PrefixCache.prefill`` (its checkpoints: a recurrent layer's state snapshot every
``--snapshot-intervals`` blocks, 0 the default spacing), every block written to
the SSD tier in one writer batch; the table gives the blocks stored, those that
lie in run files and the payload files, with ``ssd_run_tokens`` 0 (a file per
block) as the reference; then the median wall and process CPU time of a
fetch of the whole prompt from the SSD tier (a fresh cache, page cache warm)
for both, and their ratios. File counts do not depend on the machine's load; times do (compare the
ratio, measured in the same run).

    python tools/bench_run_files.py [--archs llama,gemma3_text,qwen3_next]
        [--tokens 1029] [--block-size 16] [--snapshot-intervals 0,4,1] [--repeat 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="llama,gemma3_text,qwen3_next")
    p.add_argument("--tokens", type=int, default=1029)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--snapshot-intervals", default="0,4,1")
    p.add_argument("--repeat", type=int, default=21, help="fetches timed (medians)")
    return p


def files_of(model, tokens: list[int], args, interval: int, run_tokens: int) -> dict[str, int]:
    """Blocks stored, blocks in run files and payload files of one prefill."""
    with tempfile.TemporaryDirectory() as ssd:
        config = CacheConfig(
            block_size=args.block_size,
            ssd_dir=ssd,
            hot_max_bytes=1,
            ssd_min_free_bytes=0,
            write_queue_bytes=1 << 30,
            snapshot_interval=interval,
            ssd_run_tokens=run_tokens,
            background_quiet_ms=600_000,  # the prefill's miss holds the writer: one batch
        )
        with PrefixCache(model, config, model_id="bench") as pc:
            pc.prefill(tokens, prefill_step_size=256)
            pc.flush()
            tier = pc.tiers.named("ssd")
            keys = [m.key for m in tier.iter_meta()]
            runs = [r for _, r in tier.index.get_runs(keys)]
            files = sum(len(f) for _, _, f in os.walk(os.path.join(ssd, "blocks")))
        fetch_ms = _fetch_ms(model, tokens, config.replace(promote=False), args.repeat)
    out = {"blocks": len(keys), "in_runs": sum(r is not None for r in runs), "files": files}
    return out | {"fetch_ms": fetch_ms}


def _fetch_ms(model, tokens: list[int], config: CacheConfig, repeat: int) -> tuple[float, float]:
    """Median (wall, process CPU) ms of a fetch of the whole prompt from the SSD tier
    (page cache warm), in a fresh PrefixCache (nothing in its hot tier)."""
    with PrefixCache(model, config.replace(background_quiet_ms=0), model_id="bench") as pc:
        walls, cpus = [], []
        for _ in range(repeat + 1):  # the first warms the page cache
            wall, cpu = time.perf_counter(), time.process_time()
            _, num = pc.fetch(tokens)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            assert num > 0, "nothing restored"
    return 1000 * statistics.median(walls[1:]), 1000 * statistics.median(cpus[1:])


def _ms(row: dict) -> str:
    wall, cpu = row["fetch_ms"]
    return f"{wall:.1f} ({cpu:.1f})"


def _ratio(row: dict, ref: dict) -> str:
    (wall, cpu), (ref_wall, ref_cpu) = row["fetch_ms"], ref["fetch_ms"]
    return f"{wall / ref_wall:.2f} ({cpu / ref_cpu:.2f})"


def main(argv: list[str] | None = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    tokens = np.random.default_rng(1).integers(0, 512, args.tokens).tolist()
    print(
        "| arch | snapshot_interval | blocks | in run files | files | files, one per block "
        "| fetch ms (CPU ms) | one per block | ratio (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        model = build_model(arch, seed=0)
        for interval in (int(x) for x in args.snapshot_intervals.split(",")):
            runs = files_of(model, tokens, args, interval, 256)
            alone = files_of(model, tokens, args, interval, 0)
            print(
                f"| {arch} | {interval} | {runs['blocks']} | {runs['in_runs']} "
                f"| {runs['files']} | {alone['files']} | {_ms(runs)} | {_ms(alone)} "
                f"| {_ratio(runs, alone)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
