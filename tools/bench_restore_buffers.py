"""Making a restore's buffers: one ``mx.load`` per buffer against one for them all.

A restore allocates a buffer per layer and per K/V (``restore_buffers``: MLX
allocates them unwritten through ``mx.load`` of a stream that writes nothing).
Per round, interleaved in one process: ``each`` makes the buffers with one
``empty`` per buffer, ``batched`` with one load for all (what a restore does,
``restore_buffers.batched``), each evaluated at once as a restore does; the
buffers are then freed. Prints the medians of wall and CPU time (this thread
and MLX's) of each, and their ratio; the load average, since wall times follow
the share of the cores this process gets.

    python tools/bench_restore_buffers.py [--shape llama-3.2-1b] [--tokens 4096] [--rounds 31]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
from shapes import named, num_layers

from prefixcache.memory.restore_buffers import batched, empty, resolve


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", help="a preset of tools/shapes.py")
    p.add_argument("--tokens", type=int, default=4096, help="restored tokens (+256 of headroom)")
    p.add_argument("--rounds", type=int, default=31)
    return p


def each(specs) -> None:
    arrays = [empty(shape, dtype, stream=mx.cpu) for shape, dtype in specs]
    mx.eval(arrays)


def together(specs) -> None:
    with batched(mx.cpu) as batch:
        slots = [batch.add(shape, dtype) for shape, dtype in specs]
    mx.eval(batch.arrays)
    assert len({id(resolve(s)) for s in slots}) == len(specs)


def timed(fn, specs) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn(specs)
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def main() -> None:
    args = setup_arg_parser().parse_args()
    shape = named([args.shape])[0]
    capacity = args.tokens + 256
    layers = shape.full_layers + shape.window_layers
    specs = [((1, shape.kv_heads, capacity, shape.head_dim), mx.bfloat16)] * (2 * layers)
    load = os.getloadavg()
    runs: dict[str, list[tuple[float, float]]] = {"each": [], "batched": []}
    for i in range(args.rounds):
        order = [("each", each), ("batched", together)]
        for name, fn in order if i % 2 else order[::-1]:
            runs[name].append(timed(fn, specs))
    runs = {k: v[1:] for k, v in runs.items()}  # the first round warms MLX up
    med = {k: [statistics.median(x[j] for x in v) for j in (0, 1)] for k, v in runs.items()}
    ratio = statistics.median(
        b[0] / e[0] for e, b in zip(runs["each"], runs["batched"], strict=True)
    )
    print(
        f"{shape.name}: {len(specs)} buffers of {capacity} tokens"
        f" ({num_layers(shape)} layers, {layers} with K/V)"
    )
    for name, (wall, cpu) in med.items():
        print(f"  {name:8s} wall {wall:.2f} ms  cpu {cpu:.2f} ms (median of {len(runs[name])})")
    print(f"  batched / each (wall, median of the rounds' ratios): {ratio:.2f}")
    end = os.getloadavg()
    print(f"load average (1 min) at start {load[0]:.2f}, at end {end[0]:.2f} on {os.cpu_count()}")


if __name__ == "__main__":
    main()
