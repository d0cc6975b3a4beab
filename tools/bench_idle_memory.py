"""What a copy costs on this machine by how long its memory sat idle before it.

A restore's time, and its reference's (one memcpy into one fresh buffer: the
hot restore's target), depend on more than their code here. On this project's VM,
memory left untouched for a moment is slower to touch again: a copy between
two buffers that stay allocated (no page fault at all) takes 1.5x as long
after a 0.2 s sleep and up to 5x after 5 s, and runs at full speed again at
once. No guest counter shows it (the page faults are the same),
so it comes from outside the guest; the tool also prints whether the balloon
device reports free pages to the host (its feature bit 5,
VIRTIO_BALLOON_F_REPORTING), one way a host takes memory back (not this: the
kept buffer is never freed). So compare a
fetch with its reference only within one round, after the same idle time, and
read a process's first rounds (its memory idle since the last run) apart.

Ways, each after a sleep of ``--pauses`` seconds, in rotating order each round:

  kept    a copy of the chain's bytes into a buffer allocated once (no fault)
  memcpy  into one new buffer (numpy ``empty``: the hot target's reference)
  fresh   into new buffers made as a restore makes its own (one per layer and
          K/V: ``benchlib.restore_like_buffers``, huge pages asked for)
  fetch   with ``--fetch``: ``PrefixCache.fetch`` of a hot-only chain of the first
          of ``--block-sizes``

Medians per pause: ms, page faults, and the ratios fetch / memcpy and fetch /
target (1.2 x memcpy + 1 ms).

    python tools/bench_idle_memory.py [--pauses 0 0.5 3] [--repeat 5] [--fetch [--block-sizes 16]]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import numpy as np
from benchlib import (
    add_chain_args,
    chain_fetch,
    minor_faults,
    restore_like_buffers,
    shaped_model,
)

from prefixcache import PrefixCache

MiB = 1 << 20
BALLOON, REPORTING = "0x0005", 5  # virtio device id, feature bit


def free_page_reporting() -> str:
    """'on' / 'off' for a virtio balloon device, 'no balloon device' otherwise."""
    for dev in glob.glob("/sys/bus/virtio/devices/*"):
        try:
            with open(f"{dev}/device") as f:
                if f.read().strip() != BALLOON:
                    continue
            with open(f"{dev}/features") as f:
                bits = f.read().strip()
        except OSError:
            continue
        return "on" if len(bits) > REPORTING and bits[REPORTING] == "1" else "off"
    return "no balloon device"


def ways(args, source: np.ndarray) -> tuple[dict, PrefixCache | None]:
    """The ways by name, and the fetched cache (None without ``--fetch``)."""
    kept = np.empty_like(source)
    shapes = [(1, args.kv_heads, args.tokens, args.head_dim)] * (2 * args.layers)
    pieces = np.split(source.view(np.uint16), 2 * args.layers)

    def memcpy() -> None:
        out = np.empty_like(source)
        np.copyto(out, source)

    def fresh() -> None:
        for out, piece in zip(restore_like_buffers(shapes), pieces, strict=True):
            np.copyto(out.reshape(-1), piece)

    out = {"kept": lambda: np.copyto(kept, source), "memcpy": memcpy, "fresh": fresh}
    pc = None
    if args.fetch:
        pc, out["fetch"] = chain_fetch(shaped_model(args), args, "hot", args.block_sizes[0])
    return out, pc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chain_args(p, [16], 5)
    p.add_argument("--pauses", type=float, nargs="+", default=[0.0, 0.5, 3.0], help="seconds")
    p.add_argument("--fetch", action="store_true", help="time PrefixCache.fetch in the rounds")
    args = p.parse_args()
    nbytes = 2 * args.layers * args.kv_heads * args.tokens * args.head_dim * 2
    source = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    print(f"free page reporting: {free_page_reporting()}; {nbytes / MiB:.0f} MiB, medians of "
          f"{args.repeat} rounds per pause")  # fmt: skip
    todo, pc = ways(args, source)
    try:
        measure(args, todo)
    finally:
        if pc is not None:
            pc.close()


def measure(args, todo: dict) -> None:
    """Each pause's rounds, its medians printed as a row."""
    for way in todo.values():  # first calls (allocator, kernels, threads) are no pause's
        way()
    names = list(todo)
    head = "  ".join(f"{n:>8} ms  faults" for n in names)
    extra = "  fetch / memcpy  fetch / target" if args.fetch else ""
    print(f"pause s  {head}{extra}")
    for pause in args.pauses:
        ms: dict[str, list[float]] = {n: [] for n in names}
        faults: dict[str, list[int]] = {n: [] for n in names}
        ratios, targets = [], []
        for r in range(args.repeat):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                time.sleep(pause)
                before, start = minor_faults(), time.perf_counter()
                todo[name]()
                ms[name].append((time.perf_counter() - start) * 1e3)
                faults[name].append(minor_faults() - before)
            if args.fetch:
                ratios.append(ms["fetch"][-1] / ms["memcpy"][-1])
                targets.append(ms["fetch"][-1] / (1.2 * ms["memcpy"][-1] + 1.0))
        cells = "  ".join(
            f"{statistics.median(ms[n]):11.1f}  {statistics.median(faults[n]):6.0f}" for n in names
        )
        if args.fetch:
            cells += f"  {statistics.median(ratios):14.2f}  {statistics.median(targets):14.2f}"
        print(f"{pause:7.1f}  {cells}", flush=True)


if __name__ == "__main__":
    main()
