"""What the cache costs when nothing is reused: time to first token of unrelated
prompts through ``prefixcache serve`` against plain ``mlx_lm.server``.

Both servers run side by side on the same tiny model (real subprocesses, one
request at a time). ``--prompts`` unrelated prompts of about ``--words`` words
each (no shared prefix: every request is a miss for both) go to each server in
turn, the order alternating from pair to pair; the ratio of each pair's times to
first token (ours / mlx-lm) is the measure. Rounds repeat the whole set with new
prompts. Prints every pair and the median ratio.

    python tools/bench_overhead.py [--prompts 8] [--words 1100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from reuselib.servers import Server

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
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--words", type=int, default=1100, help="about 1500 tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arch", default="llama")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = save_model(work / "model", args.arch)
        ours_argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
        ours_argv += ["--ssd-dir", str(work / "ssd"), "--block-size", str(args.block_size)]
        ours = Server("ours", ours_argv, work / "ours.log")
        plain_argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
        plain = Server("mlx-lm", plain_argv, work / "plain.log")
        try:
            ours.wait_ready()
            plain.wait_ready()
            pairs = _pairs(args, rng, ours, plain)
        finally:
            ours.stop()
            plain.stop()
    ratios = [o / p for o, p in pairs]
    print(f"\n{len(pairs)} pairs, load {os.getloadavg()}")
    print("| pair | ours TTFT ms | mlx-lm TTFT ms | ours / mlx-lm |")
    print("|---|---|---|---|")
    for i, (o, p) in enumerate(pairs):
        print(f"| {i} | {o * 1e3:.0f} | {p * 1e3:.0f} | {o / p:.3f} |")
    q = statistics.quantiles(ratios, n=4)
    print(
        f"\nmedian ours / mlx-lm {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"
    )


def _pairs(args, rng: random.Random, ours: Server, plain: Server) -> list[tuple[float, float]]:
    out = []
    for r in range(args.rounds):
        for i in range(args.prompts):
            words = " ".join(rng.choice(WORDS) for _ in range(args.words))
            messages = [{"role": "user", "content": f"{r} {i} {words}"}]
            first, second = (ours, plain) if (r * args.prompts + i) % 2 == 0 else (plain, ours)
            times = {s.name: s.first_token(messages) for s in (first, second)}
            out.append((times["ours"], times["mlx-lm"]))
            line = f"ours {times['ours'] * 1e3:.0f} ms, mlx-lm {times['mlx-lm'] * 1e3:.0f} ms"
            print(f"round {r} prompt {i}: {line}", flush=True)
    return out


if __name__ == "__main__":
    main()
