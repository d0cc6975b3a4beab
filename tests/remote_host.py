"""A long-lived "host" of the remote tier's tests: its own process, SSD directory and
PrefixCache, driven one JSON line at a time on stdin (it outlives a failover).

    python remote_host.py URL SSD_DIR [SECRET]
    {"tokens": [...], "store": true}     fetch, prefill the rest, store it, flush

Answers each line with one JSON line: the tokens the fetch restored, the last
token's logits (float32 bytes as hex), the meta key names of the prompt's full
blocks on the server, and the cache's stats.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from conftest import prefill, tiny_model

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes

BLOCK = 16


class Host:
    """A PrefixCache on a shared remote tier, and the requests it serves."""

    def __init__(self, url: str, ssd_dir: str, secret: str | None = None):
        config = CacheConfig(
            block_size=BLOCK,
            ssd_dir=ssd_dir,
            ssd_min_free_bytes=0,
            remote_url=url,
            remote_secret=secret,
            remote_breaker_failures=1,
            remote_breaker_ms=300,
            remote_timeout_ms=500,
            prefill_tokens_per_s=1,
        )
        self.model = tiny_model("llama")
        self.pc = PrefixCache(self.model, config, model_id="tiny")

    def serve(self, request: dict) -> dict:
        tokens = request["tokens"]
        cache, cached = self.pc.fetch(tokens)
        logits = prefill(self.model, tokens[cached:], cache, step=BLOCK)
        if request.get("store", True):
            self.pc.store(tokens, cache)
            self.pc.flush()
        remote = self.pc.tiers.named("remote")
        keys = chain_keys(self.pc.namespace.root_key(), token_bytes(tokens), BLOCK)
        return {
            "cached": cached,
            "logits": np.array(logits.astype(mx.float32)).tobytes().hex(),
            "names": [remote.names.meta(k) for k in keys],
            "stats": self.pc.stats(),
        }


def main() -> None:
    host = Host(*sys.argv[1:])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(host.serve(json.loads(line))), flush=True)
    host.pc.close()


if __name__ == "__main__":
    main()
