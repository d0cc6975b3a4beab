"""Reliability soak: crashes, corruption, threads, processes, disk full, memory, sustained.

Every scenario is bounded in count, stops by itself, checks every restore it
makes against the live run (bit-identical logits on the CPU, or K/V), prints
one summary line, and the run ends with a table. Exit status 1 on any wrong
restore or error. The scenarios live in tools/soaklib/ (one module each).

    python tools/soak.py                        # everything, default counts
    python tools/soak.py --only crash corrupt --kills 10 --corruptions 200
    python tools/soak.py --only sustained --minutes 10 --rates 0 20 --modes library serve
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from soaklib import corrupt, crash, diskfull, memory, procs, sustained, threads
from soaklib.common import Result, Workload, make_prompts

# room in hot for the blocks (about 128 blocks) and a few sequences kept whole, which
# come and go: a prefilled cache holds 256 tokens a buffer, 16 blocks of bytes
KEPT = {"hot_bytes": 160 * threads.BLOCK_BYTES}
SCENARIOS = ("crash", "corrupt", "threads", "kept", "procs", "diskfull", "memory", "sustained")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the temp directories go (default: $TMPDIR)")
    p.add_argument("--kills", type=int, default=50, help="crash: SIGKILLs")
    p.add_argument("--corruptions", type=int, default=1000, help="corrupt: damaged blocks")
    p.add_argument("--threads", type=int, default=8, help="threads: threads")
    p.add_argument("--thread-ops", type=int, default=10_000, help="threads: ops per thread")
    p.add_argument("--kept-ops", type=int, default=2_000, help="kept: ops per thread")
    p.add_argument("--procs", type=int, default=4, help="procs: server processes")
    p.add_argument("--proc-ops", type=int, default=500, help="procs: ops per process")
    p.add_argument("--requests", type=int, default=10_000, help="memory: requests per curve")
    p.add_argument("--sample-every", type=int, default=500, help="memory: requests per sample")
    p.add_argument("--minutes", type=float, default=10.0, help="sustained: minutes per run")
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.0, 20.0],
        help="sustained: requests per second (per client in serve mode); 0: back to back",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("library", "serve"),
        default=["library", "serve"],
        help="sustained: the library loop, a real `prefixcache serve` with 4 clients",
    )
    p.add_argument("--seconds-per-sample", type=float, default=5.0, help="sustained")
    p.add_argument("--out", default="sustained", help="sustained: CSV / PNG path prefix")
    return p


def run_sustained(args: argparse.Namespace) -> list[Result]:
    from soaklib import sustained_serve

    out = []
    for mode in args.modes:
        for rate in args.rates:
            setup = sustained.SustainedSetup(
                minutes=args.minutes,
                every=args.seconds_per_sample,
                rate=rate,
                seed=args.seed,
                out=args.out,
            )
            runner = sustained.run if mode == "library" else sustained_serve.run
            out.append(runner(setup, args.dir))
    return out


def run_one(name: str, args: argparse.Namespace) -> Result:
    if name == "crash":
        return crash.run(crash.CrashSetup(kills=args.kills, seed=args.seed), args.dir)
    if name == "corrupt":
        setup = corrupt.CorruptSetup(corruptions=args.corruptions, seed=args.seed)
        return corrupt.run(setup, args.dir)
    if name == "threads":
        setup = threads.ThreadSetup(threads=args.threads, ops=args.thread_ops, seed=args.seed)
        return threads.run(setup, args.dir)
    if name == "kept":  # threads storing as a server does: caches handed over, kept whole
        setup = threads.ThreadSetup(
            threads=args.threads, ops=args.kept_ops, seed=args.seed, hand_over=True, **KEPT
        )
        return threads.run(setup, args.dir)
    if name == "procs":
        setup = procs.ProcSetup(procs=args.procs, ops=args.proc_ops, seed=args.seed)
        return procs.run(setup, args.dir)
    if name == "diskfull":
        return diskfull.run(diskfull.DiskFullSetup(), args.dir)
    setup = memory.MemorySetup(requests=args.requests, every=args.sample_every, seed=args.seed)
    return memory.run(setup, args.dir)


def summary(r: Result) -> str:
    status = "ok" if r.ok else "FAILED"
    return (
        f"{r.name}: {status} in {r.seconds:.0f} s: {r.ops} ops, {r.checked} restores "
        f"checked exactly, {r.wrong} wrong, {r.errors} errors; {r.notes}"
    )


def table(results: list[Result]) -> str:
    rows = [
        "| scenario | result | ops | restores checked | wrong | errors | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.name} | {'ok' if r.ok else 'FAILED'} | {r.ops} | {r.checked} | "
            f"{r.wrong} | {r.errors} | {r.seconds:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # expected corruption/disk-full logs: counted
    start = time.perf_counter()
    control = Workload(make_prompts(2, 1)).negative_control()
    print(f"negative control: the exactness check rejects another prompt's cache: {control}")
    results = []
    for name in args.only:
        for result in run_sustained(args) if name == "sustained" else [run_one(name, args)]:
            results.append(result)
            print(summary(result), flush=True)
            for finding in result.findings[:10]:
                print(f"    {finding.strip()}", flush=True)
    print(f"\nseed {args.seed}, {time.perf_counter() - start:.0f} s in all\n")
    print(table(results))
    return 0 if control and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
