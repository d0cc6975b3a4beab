"""Bytes on disk of the SSD tier, read three ways while the library loop writes.

The sustained scenario's loop (soaklib/sustained.py: the tiny llama, block
16, a 2 MiB hot budget, a 16 MiB SSD cap, requests back to back) runs for
``--seconds`` while a thread walks the payload directory without pause and
sums the file sizes:

- ``plain``: every file the walk meets (what the sustained sampler read);
- ``instant``: only files older than the walk's start (``on_disk_now``): each
  was on disk at that size at that instant;
- ``locked``: every file, walked while holding the index's write lock, so no
  entry is dropped or reserved meanwhile: what is on disk is the indexed files
  plus those of writes already reserved, which the cap covers.

It prints, for each way, the largest sum, how many walks read more than the
cap and how many walks there were. A plain walk over the cap while the other
two never are means the walk, not the tier, passed the cap.

    python tools/ssd_cap_walks.py --seconds 120
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

from soaklib import common
from soaklib.sustained import Prompts

from prefixcache.tiny.models import build_model

MiB = 1 << 20
CAP = 16 * MiB


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--dir", default=None, help="where the temp directory goes")
    return p


def main(argv: list[str] | None = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    model, prompts = build_model("llama"), Prompts(0)
    seen = {way: [0, 0, 0] for way in ("plain", "instant", "locked")}  # max, over, walks
    stop = threading.Event()

    def note(way: str, nbytes: int) -> None:
        got = seen[way]
        got[0], got[1], got[2] = max(got[0], nbytes), got[1] + (nbytes > CAP), got[2] + 1

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ssd-cap-walks-") as tmp:
        cfg = common.config(tmp, hot_max_bytes=2 * MiB, ssd_max_bytes=CAP)
        cfg = cfg.replace(restore_headroom=256, ssd_min_free_bytes=1 << 30)  # the defaults
        with common.PrefixCache(model, cfg, model_id=common.MODEL_ID) as pc:
            lock = pc.tiers.named("ssd").index._shared.write_lock

            def walk() -> None:
                while not stop.is_set():
                    note("plain", common.payload_bytes(tmp))
                    note("instant", common.on_disk_now(tmp))
                    with lock:
                        note("locked", common.payload_bytes(tmp))

            walker = threading.Thread(target=walk)
            walker.start()
            end, num = time.monotonic() + args.seconds, 0
            try:
                while time.monotonic() < end:
                    tokens = prompts.next()
                    cache, n = pc.fetch(tokens)
                    common.prefill(model, tokens[n:], cache)
                    pc.store(tokens, cache)
                    num += 1
            finally:
                stop.set()
                walker.join()
            written = pc.stats()["ssd"]["num_writes"]
    print(f"{num} requests, {written} blocks written, cap {CAP} B")
    print("| walk | largest sum (B) | over the cap by | walks over the cap | walks |")
    print("|---|---|---|---|---|")
    for way, (top, over, walks) in seen.items():
        print(f"| {way} | {top:,} | {max(0, top - CAP):,} | {over} | {walks:,} |")


if __name__ == "__main__":
    main()
