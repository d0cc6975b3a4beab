"""How many SSD payload files a prefilled chain takes: run files against one per block.

Each tiny model (random weights, ``prefixcache/tiny``) prefills one prompt through
``PrefixCache.prefill`` (its checkpoints: a recurrent layer's state snapshot every
``--snapshot-intervals`` blocks, 0 the default spacing), every block written to
the SSD tier in one writer batch; the table gives the blocks stored, those that
lie in run files and the payload files, with ``ssd_run_tokens`` 0 (a file per
block) as the reference. File counts do not depend on the machine's load.

    python tools/bench_run_files.py [--archs llama,gemma3_text,qwen3_next]
        [--tokens 1029] [--block-size 16] [--snapshot-intervals 0,4,1]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="llama,gemma3_text,qwen3_next")
    p.add_argument("--tokens", type=int, default=1029)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--snapshot-intervals", default="0,4,1")
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
    return {"blocks": len(keys), "in_runs": sum(r is not None for r in runs), "files": files}


def main(argv: list[str] | None = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    tokens = np.random.default_rng(1).integers(0, 512, args.tokens).tolist()
    print("| arch | snapshot_interval | blocks | in run files | files | files, one per block |")
    print("|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        model = build_model(arch, seed=0)
        for interval in (int(x) for x in args.snapshot_intervals.split(",")):
            runs = files_of(model, tokens, args, interval, 256)
            alone = files_of(model, tokens, args, interval, 0)
            print(
                f"| {arch} | {interval} | {runs['blocks']} | {runs['in_runs']} "
                f"| {runs['files']} | {alone['files']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
