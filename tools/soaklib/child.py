"""A serving process for the crash and processes scenarios.

    python -m soaklib.child SSD_DIR SEED POLICY HOT_BYTES SSD_BYTES GROUPS PER_GROUP OPS

Serves random prompts (fetch, exactness check, store) on a PrefixCache over
SSD_DIR, now and then spilling the hot tier (``trim_hot``) or flushing. Prints
``ready`` once open, ``op I N OK`` after each op (OK: 1 if the logits were the
live run's), and a final ``done OPS CHECKED WRONG`` line; OPS 0 runs until killed.
"""

from __future__ import annotations

import random
import sys

from soaklib.common import Tally, Workload, make_prompts, open_cache


def main(argv: list[str]) -> int:
    ssd_dir, seed, policy = argv[0], int(argv[1]), argv[2]
    hot_bytes, ssd_bytes, groups, per_group, ops = map(int, argv[3:8])
    work = Workload(make_prompts(groups, per_group))
    rng = random.Random(seed)
    pc = open_cache(
        work.model,
        ssd_dir,
        hot_max_bytes=hot_bytes,
        ssd_max_bytes=ssd_bytes,
        write_policy=policy,
        queue_full="inline",
    )
    print("ready", flush=True)
    tally = Tally()
    step = 0
    while ops == 0 or step < ops:
        i = rng.randrange(len(work.prompts))
        wrong = tally.wrong
        num_cached = work.serve(pc, i, tally)
        print(f"op {i} {num_cached} {int(tally.wrong == wrong)}", flush=True)
        roll = rng.random()
        if roll < 0.1:
            pc.trim_hot(0)  # spill everything dirty now
        elif roll < 0.15:
            pc.flush()
        step += 1
    pc.close()
    print(f"done {tally.ops} {tally.checked} {tally.wrong}", flush=True)
    return 1 if tally.wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
