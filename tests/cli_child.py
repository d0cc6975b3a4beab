"""Cache directories for the CLI tests, made by a real PrefixCache in a child process.

    python cli_child.py build DIR TOKDIR   # two models, a fork; prints one JSON line
    python cli_child.py write DIR STOP     # stores new prompts until the file STOP exists

``build`` stores, with a tiny llama and block_size 16, for ``tiny/model-a`` a
64-token prompt and a second one sharing its first 32 tokens (a fork after
block 1: 6 blocks), and for ``tiny/model-b`` a 48-token prompt (3 blocks).
Token ids come from the tiny tokenizer (saved in TOKDIR) on real text, so
``show --tokenizer`` has words to decode.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiny.models import build_model, save_tokenizer

BLOCK = 16
MODELS = ("tiny/model-a", "tiny/model-b")
TEXT = (
    "The first train leaves the valley station at seven in the morning and reaches the "
    "summit an hour later. On Sundays the timetable changes: trains run every half hour "
    "from eight until six, and the last descent leaves the summit at half past six. "
    "Bicycles travel in the luggage van; dogs ride free; children under six pay nothing. "
    "In winter the line closes above the middle station when the wind is strong."
)


def config(path: str) -> CacheConfig:
    return CacheConfig(  # a file per block: the tests count each block's file bytes
        block_size=BLOCK,
        ssd_dir=path,
        ssd_min_free_bytes=0,
        write_policy="write_through",
        ssd_run_tokens=0,
    )


def keys(pc: PrefixCache, tokens: list[int]) -> list[str]:
    root = pc.namespace.root_key()
    return [k.hex() for k in chain_keys(root, token_bytes(tokens), BLOCK)]


def build(path: str, tokdir: str) -> None:
    save_tokenizer(tokdir)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(os.path.join(tokdir, "tokenizer.json")).encode(TEXT).ids
    assert len(ids) >= 160, len(ids)
    p1, p2, p3 = ids[:64], ids[:32] + ids[96:128], ids[112:160]
    model = build_model("llama")
    out: dict[str, object] = {"ids": {"p1": p1, "p2": p2, "p3": p3}}
    with PrefixCache(model, config(path), model_id=MODELS[0]) as pc:
        pc.prefill(p1)
        pc.prefill(p2)  # reuses p1's first 2 blocks
        pc.fetch([*p1, 1, 2, 3])  # a 64-token hit
        out["a"] = {"p1": keys(pc, p1), "p2": keys(pc, p2), "stats": pc.stats()}
    with PrefixCache(model, config(path), model_id=MODELS[1]) as pc:
        pc.prefill(p3)
        out["b"] = {"p3": keys(pc, p3), "stats": pc.stats()}
    print(json.dumps(out), flush=True)


def write(path: str, stop: str) -> None:
    """Store a new 48-token prompt per round (flushed: on disk at once)."""
    model = build_model("llama")
    rng = np.random.default_rng(0)
    with PrefixCache(model, config(path), model_id="tiny/model-c") as pc:
        for i in range(5000):
            if os.path.exists(stop):
                break
            pc.prefill(rng.integers(0, 512, 3 * BLOCK).tolist())
            pc.flush()
            print(f"stored {i + 1}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
    else:
        write(sys.argv[2], sys.argv[3])
