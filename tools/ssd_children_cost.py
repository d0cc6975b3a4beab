"""Children the SSD tier decodes per request under sustained traffic, against the
children a full listing of the same parents would decode (the same run).

The sustained loop of tools/sustained_table.py (the README's fetch, prefill the
rest, store; tiny llama, block 16, 2 MiB hot budget; 4 system prompts, random
user turns): every user turn leaves one more child under its system prompt's
last block, and every fetch asks the tiers for that block's children near the
prompt. Per tenth of the run: the mean children decoded per request (``near``)
and the mean a full listing of the same parents holds (``all``), plus restores
compared with the live run (every 25th request; exit status 1 if one differs).

    python tools/ssd_children_cost.py --requests 3000
    python tools/ssd_children_cost.py --requests 3000 --ssd-mib 1024
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from soaklib import common
from soaklib.sustained import Prompts, serve_one

from prefixcache import PrefixCache
from prefixcache.tiers.ssd.tier import SsdTier
from prefixcache.tiny.models import build_model

MiB = 1 << 20


class CountingSsd(SsdTier):
    """An SSD tier that counts the entries its children lookups decode."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.decoded = 0  # by every read
        self.children_decoded = 0  # by children lookups
        self.listed = 0
        decoded = self.reads.decoded

        def count(key, raw):
            self.decoded += 1
            return decoded(key, raw)

        self.reads.decoded = count

    def children(self, parent, near=None):
        self.listed += len(self.index.children(parent))  # what listing them all reads
        before = self.decoded
        found = super().children(parent, near)
        self.children_decoded += self.decoded - before
        return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--ssd-mib", type=int, default=16, help="the SSD tier's cap")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = build_model("llama")
    prompts = Prompts(args.seed)
    wrong = 0
    with tempfile.TemporaryDirectory() as tmp:
        cfg = common.config(tmp, hot_max_bytes=2 * MiB, ssd_max_bytes=args.ssd_mib * MiB)
        ssd = CountingSsd(cfg)
        with PrefixCache(model, cfg, model_id=common.MODEL_ID, tiers=[ssd]) as pc:
            print("| requests | children decoded / request | children listed / request |")
            print("|---|---|---|")
            step = max(1, args.requests // 10)
            for start in range(0, args.requests, step):
                ssd.children_decoded = ssd.listed = 0
                for k in range(start, min(start + step, args.requests)):
                    wrong += serve_one(pc, model, prompts.next(), k % 25 == 0)[2] is False
                n = min(step, args.requests - start)
                print(f"| {start + n:,} | {ssd.children_decoded / n:.1f} | {ssd.listed / n:.1f} |")
    print(f"wrong restores: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
