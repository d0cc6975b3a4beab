"""A "host" of the remote tier's tests: its own process and SSD directory, a shared server.

    python remote_child.py URL SSD_DIR store SEED NUM_TOKENS   # prefill + store, flush
    python remote_child.py URL SSD_DIR fetch SEED NUM_TOKENS   # prefill from the cache

Prints one JSON line: the last token's logits (float32 bytes as hex), the
cached token count and the cache's stats.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from conftest import prompt, tiny_model

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16


def main(url: str, ssd_dir: str, verb: str, seed: int, num_tokens: int) -> None:
    config = CacheConfig(
        block_size=BLOCK,
        ssd_dir=ssd_dir,
        ssd_min_free_bytes=0,
        remote_url=url,
        write_policy="write_through" if verb == "store" else "write_back",
    )
    tokens = prompt(seed, num_tokens)
    with PrefixCache(tiny_model("llama"), config, model_id="tiny") as pc:
        _, logits = pc.prefill(tokens)
        pc.flush()
        stats = pc.stats()
    out = np.array(logits.astype(mx.float32)).tobytes().hex()
    print(json.dumps({"logits": out, "stats": stats}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
