"""KV events on SSD run files: a chain written as one run file is published as one
BlockStored per block (the SSD medium, each with its parent), and when the run's
blocks are evicted one BlockRemoved names each of them; every removal follows its
store and the counts match the tier's writes and evictions. The control:
``ssd_run_tokens=0`` writes the same events from a file per block."""

from __future__ import annotations

import os

import pytest
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache
from test_events import receive, subscriber  # noqa: F401  (a fixture)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.background.kv_events import AllBlocksCleared, block_hash
from prefixcache.hashing import chain_keys, token_bytes

BLOCK = 16
LENGTH = 4  # blocks a chain
CHAINS = 6


def payload_files(path) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(path, "blocks")))


@pytest.mark.parametrize("run_tokens", [256, 0])
def test_a_run_file_s_blocks_are_stored_and_removed_block_by_block(
    tmp_path,
    llama,
    subscriber,  # noqa: F811
    run_tokens,
):
    port, sub = subscriber
    ssd = str(tmp_path / "ssd")
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=ssd,
        ssd_min_free_bytes=0,
        hot_max_bytes=1 << 20,
        ssd_max_bytes=3 * LENGTH * 9216,  # under three chains: older chains go
        ssd_run_tokens=run_tokens,
        events_url=f"tcp://*:{port}",
        counters_save_seconds=0,
    )
    chains = []
    with PrefixCache(llama, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        root = pc.namespace.root_key()
        for i in range(CHAINS):
            tokens = prompt(200 + i, LENGTH * BLOCK)
            cache = make_prompt_cache(llama)
            prefill(llama, tokens, cache, step=BLOCK)
            pc.store(tokens, cache)
            pc.flush()  # the chain's blocks are one batch of the writer
            chains.append([block_hash(k) for k in chain_keys(root, token_bytes(tokens), BLOCK)])
        pc.services.events.flush()
        st = pc.stats()["ssd"]
        files, held = payload_files(ssd), st["num_blocks"]
    events = [e for _, b in receive(sub) for e in b.events if type(e) is not AllBlocksCleared]
    on_ssd = [e for e in events if e.medium == "STORAGE"]
    stored = [e for e in on_ssd if type(e).__name__ == "BlockStored"]
    removed = [h for e in on_ssd if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert all(len(e.block_hashes) == 1 for e in stored)  # one event a block
    assert [e.block_hashes[0] for e in stored] == [h for c in chains for h in c]
    assert [e.parent_block_hash for e in stored] == [p for c in chains for p in [None, *c[:-1]]]
    assert len(stored) == st["num_writes"] == CHAINS * LENGTH
    assert len(removed) == st["num_evictions"] > 0
    assert held == CHAINS * LENGTH - len(removed)
    first = {h: n for n, e in enumerate(on_ssd) for h in e.block_hashes if e in stored}
    last = {h: n for n, e in enumerate(on_ssd) for h in e.block_hashes if e not in stored}
    assert all(first[h] < last[h] for h in removed)  # stored before removed
    gone = set(removed)
    if run_tokens:  # a run file goes whole: every block of its chain named removed
        assert all(set(c) <= gone or not set(c) & gone for c in chains)
        assert files == held // LENGTH
    else:  # the control: a file per block
        assert files == held
