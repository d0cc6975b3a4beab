"""Variants of a trace that a policy was not tuned on: shifted, subsampled, halves.

- ``none``: the trace as it is.
- ``shift``: each conversation (requests sharing their first two blocks) moved
  by its own random offset of up to ten minutes, then sorted by arrival again.
- ``sub0`` / ``sub1``: the conversations of one half of a seeded split.
- ``half1`` / ``half2``: the first / last half of the requests in time.

    python tools/trace_variants.py TRACE sub0 [SEED] > sub0.jsonl   # a variant as a trace
"""

from __future__ import annotations

import json
import random
import sys

from prefixcache.traces.reader import TraceRequest, read_trace


def _conversation(r: TraceRequest) -> tuple[int, ...]:
    return r.hash_ids[:2]


def make_variant(requests: list[TraceRequest], name: str, seed: int = 1) -> list[TraceRequest]:
    rng = random.Random(seed)
    if name == "none":
        return requests
    if name == "shift":
        offsets: dict[tuple[int, ...], int] = {}
        moved = []
        for r in requests:
            off = offsets.setdefault(_conversation(r), rng.randrange(600_000))
            moved.append(
                TraceRequest(r.timestamp_ms + off, r.input_length, r.output_length, r.hash_ids)
            )
        return sorted(moved, key=lambda r: r.timestamp_ms)
    if name in ("sub0", "sub1"):
        side: dict[tuple[int, ...], int] = {}
        want = int(name[-1])
        return [r for r in requests if side.setdefault(_conversation(r), rng.randrange(2)) == want]
    if name in ("half1", "half2"):
        mid = len(requests) // 2
        return requests[:mid] if name == "half1" else requests[mid:]
    raise ValueError(f"unknown variant {name!r}")


def main() -> None:
    """Write variant ``argv[2]`` (seed ``argv[3]``, 1 by default) of the trace ``argv[1]``
    to stdout, in the trace's format."""
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: trace_variants.py TRACE none|shift|sub0|sub1|half1|half2 [SEED]")
    seed = int(sys.argv[3]) if len(sys.argv) == 4 else 1
    for r in make_variant(read_trace(sys.argv[1]), sys.argv[2], seed):
        doc = {"timestamp": r.timestamp_ms, "input_length": r.input_length}
        doc |= {"output_length": r.output_length, "hash_ids": list(r.hash_ids)}
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
