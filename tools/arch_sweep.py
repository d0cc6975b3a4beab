"""Every mlx-lm architecture through the prefix cache: built tiny, stored, restored, exact.

Each module of ``mlx_lm.models`` that defines ``ModelArgs`` and ``Model`` is
built tiny from its ``ModelArgs`` (random weights, offline: sweeplib/configs.py)
and checked on the hot and the SSD tier (sweeplib/check.py): a second prompt
sharing a 96-token prefix with the first must restore it and give the live
run's logits bit for bit. One line per architecture, then a summary::

    python tools/arch_sweep.py                       # every module, prefill step 2048
    python tools/arch_sweep.py --prefill-step 16 --jobs 2
    python tools/arch_sweep.py --only llama,deepseek_v41 --csv sweep.csv
    python tools/arch_sweep.py --only bailing_moe_v3 --snapshot-ratio 16

Each architecture runs in a process of its own (a module that crashes the
interpreter is an outcome, not the end of the sweep). Exits 1 when any built
architecture gives wrong logits.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweeplib import configs
from sweeplib.check import OUTCOMES, Result, check

BUILT = "built: "  # a child's line once its model runs
ARCH_TIMEOUT = 600  # seconds for one architecture (both tiers), under contention


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-step", type=int, default=2048, choices=(16, 512, 2048))
    parser.add_argument(
        "--snapshot-ratio", type=float, default=1.0, help="the cache's snapshot_ratio"
    )
    parser.add_argument("--only", default="", help="comma-separated module names")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once")
    parser.add_argument("--csv", default="", help="also write the lines to this CSV file")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child's architecture
    return parser


def child(arch: str, step: int, ratio: float) -> Result:
    """Run one architecture in a new interpreter; a crash or a hang is its outcome."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", arch, "--prefill-step", str(step)]
    cmd += ["--snapshot-ratio", str(ratio)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=ARCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Result(arch, "", "error", detail=f"timed out after {ARCH_TIMEOUT} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return Result(**json.loads(line))
    tail = (done.stderr.strip().splitlines() or [""])[-1]
    built = [ln[len(BUILT) :] for ln in done.stdout.splitlines() if ln.startswith(BUILT)]
    outcome = "error" if built else "not built"  # crashed after or before the model ran
    detail = f"crashed (exit {done.returncode}) {tail}".strip()
    return Result(arch, built[0] if built else "", outcome, detail=detail[:160])


def line(r: Result) -> str:
    reused = f"{r.reused_hot:>3} {r.reused_ssd:>3}"
    return f"{r.arch:<24} {r.outcome:<11} {reused}  {r.max_diff:<8.3g} {r.caches}  {r.detail}"


def summary(results: list[Result], step: int, ratio: float) -> str:
    counts = Counter(r.outcome for r in results)
    built = len(results) - counts["not built"]
    rows = [f"prefill step {step}, snapshot_ratio {ratio}: {len(results)} modules, {built} built"]
    rows += [f"  {name:<12} {counts[name]:>4}" for name in OUTCOMES]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.one:
        note = lambda c: print(BUILT + c, flush=True)  # noqa: E731
        result = check(args.one, args.prefill_step, note, ratio=args.snapshot_ratio)
        print(json.dumps(dataclasses.asdict(result)))
        return 0
    names = [n for n in args.only.split(",") if n] or configs.modules()
    archs = [n for n in names if args.only or configs.has_model(n)]
    print(f"{'architecture':<24} {'outcome':<11} hot ssd  max diff cache types")
    began = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = []
        for r in pool.map(lambda a: child(a, args.prefill_step, args.snapshot_ratio), archs):
            print(line(r), flush=True)
            results.append(r)
    print(summary(results, args.prefill_step, args.snapshot_ratio))
    print(f"{time.perf_counter() - began:.0f} s")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([field.name for field in dataclasses.fields(Result)])
            writer.writerows(dataclasses.astuple(r) for r in results)
    return 1 if any(r.outcome == "wrong" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
