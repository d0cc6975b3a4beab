"""A child process that serves a few requests through a PrefixCache, then waits to be killed.

python counters_child.py DIR SAVE_SECONDS   # prints "done", waits 1 s, prints "waited"
"""

from __future__ import annotations

import sys
import time

from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache


def main() -> None:
    path, seconds = sys.argv[1], float(sys.argv[2])
    model = tiny_model()
    config = CacheConfig(ssd_dir=path, block_size=16, counters_save_seconds=seconds)
    pc = PrefixCache(model, config)
    tokens = prompt(1, 64)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    pc.store(tokens, cache)
    for _ in range(3):
        pc.fetch(tokens)
    print("done", flush=True)
    time.sleep(1.0)  # longer than the save interval of the test
    print("waited", flush=True)
    sys.stdin.read()  # until killed: no flush, no close


if __name__ == "__main__":
    main()
