"""Reliability soak: crashes, corruption, threads, processes, disk full, memory.

Every scenario is bounded in count, stops by itself, checks every restore it
makes against the live run (bit-identical logits on the CPU, or K/V), prints
one summary line, and the run ends with a table. Exit status 1 on any wrong
restore or error. The scenarios live in tools/soaklib/ (one module each).

    python tools/soak.py                        # everything, default counts
    python tools/soak.py --only crash corrupt --kills 10 --corruptions 200
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from soaklib import corrupt, crash, diskfull, memory, procs, threads
from soaklib.common import Result, Workload, make_prompts

# room in hot for the blocks (about 128 blocks) and a few sequences kept whole, which
# come and go: a prefilled cache holds 256 tokens a buffer, 16 blocks of bytes
KEPT = {"hot_bytes": 160 * threads.BLOCK_BYTES}
SCENARIOS = ("crash", "corrupt", "threads", "kept", "procs", "diskfull", "memory")


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
    return p


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
        result = run_one(name, args)
        results.append(result)
        print(summary(result), flush=True)
        for finding in result.findings[:10]:
            print(f"    {finding.strip()}", flush=True)
    print(f"\nseed {args.seed}, {time.perf_counter() - start:.0f} s in all\n")
    print(table(results))
    return 0 if control and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
