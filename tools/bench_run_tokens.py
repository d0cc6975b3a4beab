"""SSD fetches of one chain written with several ``ssd_run_tokens``, in ONE process.

For each preset shape of tools/shapes.py (``--shape``, or ``all``) and block size,
one 4,096-token chain shaped like it is stored and flushed into one SSD tier per
``--run-tokens`` value (hot kept empty, no promotion: ``benchlib.tier_config``);
then round after round each tier's fetch of the whole chain runs, in turn first,
so every value meets the same memory state and load. Longer run files mean fewer
files and longer pieces per (batch, head) row (at 256 tokens of a 64-dim bf16
head, 32 KiB: xxhash holds the interpreter lock for updates up to 64 KiB, so two
readers hash one at a time), but the writer joins a whole run in memory before
writing it, and a run file's bytes are freed only with its last block.

Per shape, block size and value: the median fetch ms, its ratio to the first
value's (median of per-round ratios), the payload files and the largest one's
MiB (what the writer joins at once). With ``--prefix N``, each round also
fetches a prompt sharing only the chain's first N tokens (a shared system
prompt, say): a restore that uses part of a run file still reads and hashes
the file up to its last tensor used, so longer runs cost such hits more
(``prefix ms``, ``prefix / first``). ``--run-growth G ...`` adds a tier per G
with the first ``--run-tokens`` value and ``ssd_run_growth=G`` (runs growing
with their depth in the chain: ``run tokens`` reads ``256+0.5``).

    python tools/bench_run_tokens.py [--shape all] [--blocks 16,256]
        [--run-tokens 256 512 1024] [--run-growth 0.5 1] [--tokens 4096] [--repeat 11]
        [--prefix 600]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import mlx.core as mx
from benchlib import tier_config
from shapes import model_for, named, stored_chain

from prefixcache import PrefixCache

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["all"], help="presets of tools/shapes.py, or all")
    p.add_argument("--blocks", default="16,256", help="block sizes, comma-separated")
    p.add_argument("--run-tokens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--run-growth", type=float, nargs="+", default=[], help="ssd_run_growth values")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--prefix", type=int, default=0, help="also fetch the first N tokens' hit")
    p.add_argument("--dir", default=None, help="parent directory of the SSD tiers")
    return p


def payload_sizes(ssd_dir: str) -> list[int]:
    blocks = os.path.join(ssd_dir, "blocks")
    return [os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(blocks) for f in names]


def variants(args) -> dict[str, tuple[int, float]]:
    """Each tier's label and its (ssd_run_tokens, ssd_run_growth)."""
    out = {str(t): (t, 0.0) for t in args.run_tokens}
    first = args.run_tokens[0]
    return out | {f"{first}+{g:g}": (first, g) for g in args.run_growth if g}


def measure(args, shape, model, block_size: int, root: str) -> list[dict[str, object]]:
    runs = variants(args)
    values = list(runs)
    with contextlib.ExitStack() as stack:
        caches, sizes = {}, {}
        for value, (tokens, growth) in runs.items():
            ssd = os.path.join(root, f"ssd{block_size}-{value}")
            cfg = tier_config("ssd", block_size, ssd)
            cfg = cfg.replace(ssd_run_tokens=tokens, ssd_run_growth=growth)
            pc = stack.enter_context(PrefixCache(model, cfg, model_id="bench"))
            caches[value] = (pc, stored_chain(pc, shape, model, args.tokens)[0])
            sizes[value] = payload_sizes(ssd)

        def fetch(value: str, prefix: int = 0) -> float | None:
            pc, probe = caches[value]
            # a prefix's hit: its whole blocks, or every token of it (a block cut short)
            want = {prefix // block_size * block_size, prefix} if prefix else {args.tokens}
            start = time.perf_counter()
            cache, num = pc.fetch([*probe[:prefix], 512] if prefix else probe)  # 512: none of its
            mx.eval([c.state for c in cache])
            took = time.perf_counter() - start
            if prefix and not num:  # a recurrent layer's state kept at no block of it
                return None
            if num not in want:
                raise AssertionError(f"fetch restored {num} tokens, not {sorted(want)}")
            return took

        for value in values:  # warm: the page cache, MLX's first buffers
            fetch(value)
        times: dict[str, list[float]] = {value: [] for value in values}
        parts: dict[str, list[float]] | None = {value: [] for value in values}
        for i in range(args.repeat):
            for value in values[i % len(values) :] + values[: i % len(values)]:
                times[value].append(fetch(value))
                if args.prefix and parts is not None:
                    took = fetch(value, args.prefix)
                    if took is None:
                        parts = None
                    else:
                        parts[value].append(took)
    return [_row(shape.name, block_size, value, times, parts, sizes[value]) for value in values]


def _row(name: str, block: int, value: str, times: dict, parts, sizes: list[int]) -> dict:
    first = times[next(iter(times))]
    part = parts[next(iter(parts))] if parts is not None else []
    row = {"shape": name, "block": block, "run tokens": value}
    row["fetch ms"] = statistics.median(times[value]) * 1e3
    row["/ first"] = statistics.median(t / f for t, f in zip(times[value], first, strict=True))
    if parts is None:  # no prefix restorable: the columns stay
        row["prefix ms"] = row["prefix / first"] = "-"
    elif part:
        row["prefix ms"] = statistics.median(parts[value]) * 1e3
        row["prefix / first"] = statistics.median(
            t / f for t, f in zip(parts[value], part, strict=True)
        )
    return row | {"files": len(sizes), "largest MiB": max(sizes) / MiB}


def main() -> None:
    args = setup_arg_parser().parse_args()
    if any(v < 0 for v in args.run_tokens):
        raise SystemExit(f"--run-tokens must be 0 or more, got {args.run_tokens}")
    if any(not 0 <= g <= 16 for g in args.run_growth):
        raise SystemExit(f"--run-growth must be 0 to 16, got {args.run_growth}")
    if not 0 <= args.prefix < args.tokens:
        raise SystemExit(f"--prefix must be 0 to {args.tokens - 1}, got {args.prefix}")
    rows = []
    for shape in named(args.shape):
        model = model_for(shape)
        for block_size in (int(b) for b in args.blocks.split(",") if b):
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                rows += measure(args, shape, model, block_size, root)
            print(
                " ".join(
                    f"{k}={v:.2f}" if type(v) is float else f"{k}={v}" for k, v in rows[-1].items()
                ),
                flush=True,
            )
    keys = list(rows[0])
    print(f"\n{args.tokens} tokens, medians of {args.repeat}, each value's fetch in turn first")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print(
            "| "
            + " | ".join(f"{row[k]:.2f}" if type(row[k]) is float else str(row[k]) for k in keys)
            + " |"
        )
    print(f"load average (1 min) at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
