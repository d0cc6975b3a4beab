"""Sessions on SSD run files (the default ``ssd_run_tokens``): ending a session drops
its own blocks from a run file that also holds a shared prefix; the file stays,
charged once, while any of its blocks is indexed, and is unlinked with its last
one; what stays restores from it bit for bit. The control: the shared prefix's
logits differ once a block of it is changed."""

from __future__ import annotations

import os

from conftest import live_logits, max_diff, prefill
from test_sessions import BLOCK, config, convo, filled, indexed  # noqa: F401  (a fixture)

from prefixcache import PrefixCache
from prefixcache.hashing import chain_keys, token_bytes


def disk_bytes(tmp_path) -> int:
    return sum(p.stat().st_size for p in (tmp_path / "ssd").rglob("*.safetensors"))


def test_end_session_drops_its_blocks_from_a_shared_run_file(tmp_path, llama, convo):  # noqa: F811
    shared, (a, cache_a), (b, cache_b) = convo
    cfg = config(tmp_path, ssd_run_tokens=256, hot_max_bytes=1 << 20)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(a, cache_a, session="alice")
        pc.flush()  # alice's 7 blocks: one run file (the shared 4 and her 3)
        pc.store(b, cache_b, session="bob")
        pc.flush()
        ssd = pc.tiers.named("ssd")
        keys = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)
        runs = [r for _, r in ssd.index.get_runs(keys)]
        assert [r.position for r in runs] == list(range(7)) and len({r.file_key for r in runs}) == 1
        run_file = ssd.payload_file(keys[0])
        assert pc.end_session("alice") == 4  # her 3 own blocks and her tail
        assert not set(keys[4:]) & {bytes.fromhex(k) for k in indexed(pc)}
        assert os.path.exists(run_file)  # the shared prefix's blocks still lie in it
        assert ssd.stats()["nbytes"] == disk_bytes(tmp_path)  # the file charged once
        pc.trim_hot(0)  # what follows is read from the SSD tier
        cache, num = pc.fetch([*shared, 7])
        assert num == len(shared) and pc.stats()["ssd_block_hits"] >= 4
        want = live_logits(llama, [*shared, 7], num, step=BLOCK)
        assert max_diff(prefill(llama, [7], cache, step=BLOCK), want) == 0.0
        bad, _ = pc.fetch([*shared, 7])  # the control: one block of the prefix changed
        bad[0].keys[..., BLOCK : 2 * BLOCK, :] += 1
        assert max_diff(prefill(llama, [7], bad, step=BLOCK), want) > 0.0
        assert pc.end_session("bob") == 2 + 1  # bob's own; the shared prefix stays
        assert len(indexed(pc)) == 4 and os.path.exists(run_file)
        assert ssd.remove(keys[3::-1]) == 4  # the run file's last blocks: it goes with them
        assert not os.path.exists(run_file) and disk_bytes(tmp_path) == ssd.stats()["nbytes"]
