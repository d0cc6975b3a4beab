"""The SSD tier's per-file costs on the small-file path, by part, in ONE thread.

A chain of ``--shape`` (tools/shapes.py presets) is stored at ``--block-size`` on
the SSD tier; then over its payload files (warm, in the page cache), alternating
each way with the other in every round, one thread (no other thread contends for
the interpreter), this process's CPU time per file:

  open by path    ``files.open_sized``: the fan-out directory opened, the file
                  opened in it (``O_NOFOLLOW`` both), ``fstat``, closes
  open in root    ``files.PayloadRoot.open``: one ``openat2`` below the payloads'
                  root held open (where the kernel has it), ``fstat``, close
  parse each      ``payload.parse_header`` of each file's header
  parse per run   ``headers.Headers.parse``: a run's first header parsed, the
                  others of its layout compared with it (``--run-files`` a run)
  read + hash     each file read whole into a reused buffer and hashed: what
                  every verified small file costs whatever its opening and parse

    python tools/bench_ssd_files.py [--shape llama-3.2-1b] [--block-size 16]
        [--run-files 16] [--repeat 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import xxhash
from benchlib import tier_config
from shapes import filled_cache, model_for, named

from prefixcache import PrefixCache
from prefixcache.tiers.ssd.files import PayloadRoot, list_files, open_sized
from prefixcache.tiers.ssd.headers import Headers
from prefixcache.tiers.ssd.payload import parse_header


def store(shape_name: str, block_size: int, root: str) -> str:
    """The payloads' root of a 4,096-token chain of ``shape_name`` stored on the SSD."""
    shape = named([shape_name])[0]
    model = model_for(shape)
    tokens = np.random.default_rng(0).integers(0, 512, 4096).tolist()
    cfg = tier_config("ssd", block_size, os.path.join(root, "ssd"))
    with PrefixCache(model, cfg, model_id="bench") as pc:
        pc.store(tokens, filled_cache(shape, model, 4096))
        pc.flush()
    return os.path.join(cfg.ssd_path, "blocks")


def ways(blocks: str, run_files: int) -> tuple[dict, int, PayloadRoot]:
    files = sorted(list_files(blocks)[0].items())
    heads = []
    for key, path in files:
        with open(path, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        heads.append((key, raw[8 : 8 + n], len(raw) - 8 - n))
    root = PayloadRoot(blocks)
    scratch = np.empty(max(os.path.getsize(p) for _, p in files), np.uint8)

    def by_path():
        for _, path in files:
            os.close(open_sized(path)[0])

    def in_root():
        for _, path in files:
            os.close(root.open(path)[0])

    def parse_each():
        for key, text, data in heads:
            parse_header(text, key, data)

    def per_run():
        headers = Headers()
        for i, (key, text, data) in enumerate(heads):
            if i % run_files == 0:
                headers = Headers()
            headers.parse(text, key, data)

    def read_hash():
        for _, path in files:
            fd, size = root.open(path)
            try:
                os.preadv(fd, [scratch[:size]], 0)
            finally:
                os.close(fd)
            xxhash.xxh3_64_intdigest(scratch[:size])

    named_ways = {
        "open by path": by_path,
        "open in root": in_root,
        "parse each": parse_each,
        "parse per run": per_run,
        "read + hash": read_hash,
    }
    return named_ways, len(files), root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--run-files", type=int, default=16)
    p.add_argument("--repeat", type=int, default=21)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        blocks = store(args.shape, args.block_size, tmp)
        fns, count, root = ways(blocks, args.run_files)
        took: dict[str, list[float]] = {name: [] for name in fns}
        try:
            for r in range(args.repeat):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                for name in order:
                    start = time.thread_time()
                    fns[name]()
                    took[name].append((time.thread_time() - start) / count)
        finally:
            root.close()
    load = os.getloadavg()[0]
    print(f"{args.shape} at block {args.block_size}: {count} files, load {load:.2f} on 2 cores")
    print("| part | CPU us per file (median) |\n|---|---|")
    for name, times in took.items():
        print(f"| {name} | {statistics.median(times) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
