"""The least a verified restore of many small block files can cost, against one file.

Issue 19's SSD target: a warm restore of a chain of many small blocks within
1.5x of one read of the same bytes as one file. This measures, with no
prefixcache code, what any restore that keeps one checksummed file per block
must do on this machine, warm (page cache), for the same 128 MiB chain as
``tools/bench_blocks.py`` (8 layers, 8 KV heads, head_dim 128, bf16):

  file     the reference: ONE file of the chain's bytes read into ONE fresh
           buffer (``readinto``), as bench_blocks measures it
  scratch  per block file: open, one read of the whole file into a reused
           scratch buffer, one xxh3 of it, then each of its tensors copied into
           its place in fresh (1, heads, tokens, dim) buffers (one numpy copy
           per tensor and run of consecutive blocks, up to 8 MiB a run): the
           checksum is known before a byte is placed
  direct   per block file: one ``preadv`` straight into place (an iovec per
           tensor and head: bs x dim x 2 bytes each) and one xxh3 streamed over
           the placed rows: one copy, but a hash update per row

With ``--fetch``, a fourth way joins the same rounds: ``PrefixCache.fetch`` of a
chain of the same shape and block size from the SSD tier (hot kept empty, no
promotion: ``benchlib.tier_config``), so the table also gives the fetch
against the file and against the faster of the two restores above, measured in
one run (the file read's time moves between runs on this VM, 19-32 ms).

Both restores run on ``--threads`` threads (default: the cores, and one more),
each a contiguous share of the blocks; the best of the thread counts is kept.
A block's rows are strided in mlx-lm's (B, heads, tokens, dim) layout, so a
block file is scattered into 2 x layers x heads pieces of ``bs x dim`` elements
whatever the file holds; only a file spanning many blocks (not one per block)
could be read as a few runs. Medians of per-round ratios (each round runs the
three back to back, in rotating order), with the CPU time of each (this
process, every thread).

    python tools/bench_ssd_bound.py [--block-sizes 16 32 64 256] [--repeat 7] [--fetch]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import xxhash
from benchlib import (
    add_chain_args,
    chain_fetch,
    read_fresh,
    read_into_fresh,
    restore_like_buffers,
    shaped_model,
)

MiB = 1 << 20
RUN_BYTES = 8 * MiB  # a run of consecutive blocks copied per tensor at once (as runs.py)
HEADER = 4096  # bytes before the tensors (a safetensors header's size, order of magnitude)


def write_random(path: str, nbytes: int) -> None:
    """A file of ``nbytes`` random bytes (whole MiB), written a MiB at a time."""
    with open(path, "wb") as f:
        for _ in range(nbytes // MiB):
            f.write(os.urandom(MiB))


def write_chain(work: str, args, bs: int) -> list[str]:
    """One file per block: a header, then 2 x layers tensors of (1, heads, bs, dim)."""
    rng = np.random.default_rng(bs)
    per = 2 * args.layers * args.kv_heads * bs * args.head_dim * 2
    paths = []
    for i in range(args.tokens // bs):
        path = os.path.join(work, f"b{bs}-{i}")
        with open(path, "wb") as f:
            f.write(bytes(HEADER))
            f.write(rng.integers(0, 255, per, dtype=np.uint8).tobytes())
        paths.append(path)
    return paths


def fresh_buffers(args) -> list[np.ndarray]:
    """One buffer per layer and K/V, made as a fetch makes its own: numpy's
    ``empty`` would hand back pages malloc kept from the round before, or not,
    depending on what the process freed earlier (16-42 ms for the same restore
    across runs here)."""
    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    return restore_like_buffers([shape] * (2 * args.layers))


def share(n: int, threads: int) -> list[range]:
    return [range(k * n // threads, (k + 1) * n // threads) for k in range(threads)]


def run_threads(fn, parts: list[range]) -> None:
    workers = [threading.Thread(target=fn, args=(p,)) for p in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def scratch_restore(paths: list[str], args, bs: int, threads: int) -> list[np.ndarray]:
    bufs = fresh_buffers(args)
    tensor = args.kv_heads * bs * args.head_dim  # uint16 elements
    size = HEADER + 2 * args.layers * tensor * 2
    per_run = max(1, RUN_BYTES // size)

    def work(blocks: range) -> None:
        scratch = np.empty(per_run * size, np.uint8)
        view = memoryview(scratch)
        for start in range(blocks.start, blocks.stop, per_run):
            run = range(start, min(start + per_run, blocks.stop))
            for j, i in enumerate(run):
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    got = os.readv(fd, [view[j * size : (j + 1) * size]])
                finally:
                    os.close(fd)
                if got != size:
                    raise OSError(f"{paths[i]}: {got} bytes")
                xxhash.xxh3_64_intdigest(view[j * size : (j + 1) * size])
            body = scratch[: len(run) * size].reshape(len(run), size)[:, HEADER:]
            body = body.view(np.uint16).reshape(len(run), 2 * args.layers, args.kv_heads, bs, -1)
            for t, buf in enumerate(bufs):  # (heads, blocks, bs, dim): a view, never a copy
                dest = buf[0].reshape(args.kv_heads, -1, bs, args.head_dim)[:, run.start : run.stop]
                np.copyto(dest.transpose(1, 0, 2, 3), body[:, t])

    run_threads(work, share(len(paths), threads))
    return bufs


def direct_restore(paths: list[str], args, bs: int, threads: int) -> list[np.ndarray]:
    bufs = fresh_buffers(args)
    place_files(paths, bufs, args, bs, threads)
    return bufs


def place_files(paths: list[str], bufs: list[np.ndarray], args, bs: int, threads: int) -> None:
    """Each file of ``bs`` tokens read straight into its rows of ``bufs`` (one
    ``readv``, an iovec per tensor and head), then hashed over the placed rows."""

    def work(blocks: range) -> None:
        header = bytearray(HEADER)
        for i in blocks:
            lo = i * bs
            rows = [memoryview(header)]
            rows += [
                memoryview(buf[0, h, lo : lo + bs, :]).cast("B")
                for buf in bufs
                for h in range(args.kv_heads)
            ]
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.readv(fd, rows)
            finally:
                os.close(fd)
            hasher = xxhash.xxh3_64()
            for row in rows:
                hasher.update(row)
            hasher.intdigest()

    run_threads(work, share(len(paths), threads))


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(ref: str, paths: list[str], args, bs: int, fetch=None) -> str:
    """One table row: the file read, each restore at its best thread count, and
    prefixcache's fetch when given."""
    ways = {"file": lambda: read_into_fresh(ref, os.path.getsize(ref))}
    if fetch is not None:
        ways["fetch"] = fetch
    for n in args.threads:
        ways[f"scratch{n}"] = lambda n=n: scratch_restore(paths, args, bs, n)
        ways[f"direct{n}"] = lambda n=n: direct_restore(paths, args, bs, n)
    walls: dict[str, list[float]] = {k: [] for k in ways}
    cpus: dict[str, list[float]] = {k: [] for k in ways}
    names = list(ways)
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu = timed(ways[name])
            walls[name].append(wall)
            cpus[name].append(cpu)
    med = {k: statistics.median(v) * 1e3 for k, v in walls.items()}
    s = min((k for k in ways if k.startswith("scratch")), key=med.__getitem__)
    d = min((k for k in ways if k.startswith("direct")), key=med.__getitem__)
    ratio = {
        k: statistics.median(w / f for w, f in zip(walls[k], walls["file"], strict=True))
        for k in (s, d)
    }
    cpu = {k: statistics.median(cpus[k]) / statistics.median(cpus["file"]) for k in (s, d)}
    row = (
        f"| {bs} | {len(paths)} | {med['file']:.1f} | {med[s]:.1f} ({s[7:]} threads) "
        f"| {med[d]:.1f} ({d[6:]} threads) | {ratio[s]:.2f} | {ratio[d]:.2f} "
        f"| {min(ratio.values()):.2f} | {cpu[s]:.2f} | {cpu[d]:.2f} |"
    )
    if fetch is None:
        return row
    per_round = zip(walls["fetch"], walls["file"], walls[s], walls[d], strict=True)
    over_file, over_best = zip(*((w / f, w / min(a, b)) for w, f, a, b in per_round), strict=True)
    return (
        f"{row} {med['fetch']:.1f} | {statistics.median(over_file):.2f} "
        f"| {statistics.median(over_best):.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16, 32, 64, 256], 7)
    cores = os.cpu_count() or 2
    p.add_argument("--threads", type=int, nargs="+", default=[cores, cores + 1])
    p.add_argument("--dir", default=None)
    p.add_argument("--fetch", action="store_true", help="time PrefixCache.fetch in the rounds")
    args = p.parse_args()
    args.model = shaped_model(args) if args.fetch else None
    nbytes = 2 * args.layers * args.kv_heads * args.tokens * args.head_dim * 2
    print(
        f"{nbytes / MiB:.0f} MiB chain, warm; threads {args.threads}; load average "
        f"{os.getloadavg()[0]:.2f} on {cores} cores"
    )
    head = (
        "| block | files | file ms | scratch ms | direct ms | scratch / file | direct / file "
        "| best / file | cpu: scratch / file | cpu: direct / file |"
    )
    extra = " fetch ms | fetch / file | fetch / best restore |" if args.fetch else ""
    print(head + extra)
    print("|---" * (10 + 3 * args.fetch) + "|")
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        ref = os.path.join(work, "one")
        write_random(ref, nbytes)
        for bs in args.block_sizes:
            paths = write_chain(work, args, bs)
            read_fresh([ref, *paths])  # into the page cache
            got = scratch_restore(paths, args, bs, 2), direct_restore(paths, args, bs, 2)
            if not all(np.array_equal(a, b) for a, b in zip(*got, strict=True)):
                raise AssertionError("the two restores placed different bytes")
            del got
            pc, fetch = None, None
            if args.fetch:
                pc, fetch = chain_fetch(args.model, args, "ssd", bs, os.path.join(work, f"ssd{bs}"))
                fetch()  # MLX's first allocations
            try:
                print(measure(ref, paths, args, bs, fetch), flush=True)
            finally:
                if pc is not None:
                    pc.close()
            for path in paths:
                os.remove(path)
    print(
        "targets: restore <= 1.5x file (issue 19). The restores' buffers are made as a "
        "fetch makes its own (benchlib.restore_like_buffers)."
    )


if __name__ == "__main__":
    main()
