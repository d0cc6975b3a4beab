"""tools/adaptive_ablation.py: the library's adaptive policy with parts switched off.

Its ``default`` row is the library's policy as ``simulate`` runs it; ``counts``
(no ``cost`` victim while the reach is unknown) ranks a fresh cache as LRU
does, which keeps other blocks than the default on a scan; the library's
settings are back as they were after each run.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from adaptive_ablation import point

from prefixcache.tiers.hot import adaptive, eviction
from prefixcache.traces.reader import read_trace
from prefixcache.traces.shapes import PRESETS
from prefixcache.traces.simulator import SimConfig, Simulation

LLAMA = PRESETS["llama-3.1-8b"]
BLOCK = LLAMA.block_bytes(512)


def _scan_trace(path) -> str:
    """A popular 3-block chain every third request, one-off 6-block chains between."""
    with open(path, "w") as f:
        fresh = 1000
        for t in range(900):
            ids = [1, 2, 3] if t % 3 == 0 else list(range(fresh, fresh + 6))
            fresh += 0 if t % 3 == 0 else 6
            doc = {"timestamp": t, "input_length": 512 * len(ids), "output_length": 1}
            f.write(json.dumps(doc | {"hash_ids": ids}) + "\n")
    return str(path)


def _simulated(path: str, eviction_name: str) -> float:
    sim = Simulation(SimConfig(LLAMA, 16 * BLOCK, eviction=eviction_name))
    return 100 * float(sim.run(read_trace(path)).as_json()["hit_rate_last_half"])  # type: ignore[arg-type]


def test_default_row_is_the_library_and_counts_ranks_as_lru(tmp_path) -> None:
    path = _scan_trace(tmp_path / "t.jsonl")
    budget = 16 * BLOCK

    def row(name: str) -> float:
        return point((name, budget, "llama-3.1-8b", path, None))[2]

    default, counts = row("default"), row("counts")
    assert default == _simulated(path, "adaptive")
    assert counts == _simulated(path, "lru")  # LRU until the reach is known
    assert counts != default  # control: cost's victim keeps other blocks here
    # the library's settings are restored
    assert adaptive.INHERIT_UP_TO == 4 and adaptive.RECENT_FROM == 0.9
    assert eviction.AdaptivePolicy is adaptive.AdaptivePolicy
