"""Partial blocks through the SSD tier: tails spilled from hot, kept across a restart,
and full blocks a prompt diverges inside restored from the SSD only.

As in test_partial_blocks.py, every restore is compared bit-exactly with a live run
chunked alike, with a negative control (another sequence's block or tail,
restored the same way, gives other logits).
"""

from __future__ import annotations

import json
import threading

import pytest
from conftest import max_diff, prompt, tiny_model
from dict_tier import DictTier, PlainDictTier
from test_partial_blocks import TRIMMABLE, continued, finished, reference

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiers.base import ListsChildren

BLOCK = 16


def ssd_pc(model, tmp_path, kv=None, **overrides) -> PrefixCache:
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        **quant,
        **overrides,
    )
    return PrefixCache(model, config, model_id="tiny")


@pytest.mark.parametrize("case", ["kv", "rotating"])
def test_tail_evicted_from_hot_restores_from_ssd(case, tmp_path):
    arch, overrides, kv = TRIMMABLE[case]
    model = tiny_model(arch, **overrides)
    a = prompt(1, 45)  # 2 full blocks and a 13-token tail
    other = a[:32] + prompt(2, 13)  # same full blocks, another tail
    probe = a + prompt(3, 7)
    with ssd_pc(model, tmp_path, kv, promote=False) as pc:
        pc.store(a, finished(model, a, kv))
        pc.store(other, finished(model, other, kv))
        assert pc.trim_hot(0) == 4  # both tails and both blocks spill (write_back)
        pc.flush()
        assert len(pc.hot) == 0
        parent = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)[1]
        assert sorted(m.num_tokens for m in pc.ssd.children(parent)) == [13, 13]
        assert pc.match(probe) == 45
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 45
        assert pc.stats()["ssd_block_hits"] == 3
        want = reference(model, probe, 45, kv=kv)
        assert max_diff(continued(model, cache, probe[45:], kv), want) == 0.0
        # negative control: the other tail, restored from the SSD the same way
        theirs, num_theirs = pc.fetch([*other, 1])
        assert num_theirs == 45
        assert max_diff(continued(model, theirs, probe[45:], kv), want) > 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_next_turn_after_a_restart_restores_the_whole_sequence(arch, tmp_path):
    """A conversation's next turn (stored sequence + new tokens) after the cache was
    closed and reopened: every stored token, the tail and its recurrent state too."""
    model = tiny_model(arch)
    turn = prompt(1, 45)
    other = turn[:32] + prompt(2, 13)
    with ssd_pc(model, tmp_path) as pc:
        pc.store(turn, finished(model, turn))
        pc.store(other, finished(model, other))
    nxt = turn + prompt(3, 9)
    with ssd_pc(model, tmp_path) as pc:
        cache, num_cached = pc.fetch(nxt)
        assert num_cached == len(turn)
        assert pc.stats()["ssd_block_hits"] == 3
        want = reference(model, nxt, len(turn))
        assert max_diff(continued(model, cache, nxt[len(turn) :]), want) == 0.0
        # negative control: the other conversation's tail (its state, for qwen3_next)
        theirs, num_theirs = pc.fetch([*other, 1])
        assert num_theirs == len(turn)
        assert max_diff(continued(model, theirs, nxt[len(turn) :]), want) > 0.0


def test_prompt_diverging_inside_a_block_only_ssd_holds(tmp_path):
    model = tiny_model("llama")
    a = prompt(1, 64)  # block 2 is [32, 48)
    other = a[:32] + prompt(2, 32)
    probe = a[:40] + prompt(3, 10)  # diverges at token 40, inside block 2
    with ssd_pc(model, tmp_path, hot_max_bytes=1) as pc:  # every block on the SSD only
        pc.store(a, finished(model, a))
        pc.store(other, finished(model, other))
        pc.flush()
        assert len(pc.hot) == 0
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 40
        assert pc.stats()["ssd_block_hits"] == 3
        want = reference(model, probe, 40)
        assert max_diff(continued(model, cache, probe[40:]), want) == 0.0
        # negative control: the other sequence's block 2, cut back alike (tokens 32..40)
        theirs, num_theirs = pc.fetch(other[:40] + probe[40:])
        assert num_theirs == 40
        assert max_diff(continued(model, theirs, probe[40:]), want) > 0.0


@pytest.mark.parametrize("tier_class", [DictTier, PlainDictTier])
def test_tails_go_only_to_tiers_that_list_children(tier_class, llama):
    tokens = prompt(1, 45)
    tier = tier_class()
    config = CacheConfig(ssd_run_tokens=0, block_size=BLOCK, hot_max_bytes=1)
    with PrefixCache(llama, config, model_id="tiny", tiers=[tier]) as pc:
        pc.store(tokens, finished(llama, tokens))
        pc.flush()
        assert sorted(len(e.tokens) // 4 for e in tier.entries.values()) == (
            [13, 16, 16] if isinstance(tier, ListsChildren) else [16, 16]
        )
        assert pc.fetch([*tokens, 1])[1] == (45 if isinstance(tier, ListsChildren) else 32)


def test_cli_inspects_and_verifies_tails(tmp_path, llama, capsys):
    """ls, show, tree, verify and gc on a directory holding tails (written through)."""
    from prefixcache.cli import main

    a = prompt(1, 45)
    with ssd_pc(llama, tmp_path, write_policy="write_through") as pc:
        for tokens in (a, a[:32] + prompt(2, 13)):
            pc.store(tokens, finished(llama, tokens))
        parent = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)[1]
        tails = {m.key.hex() for m in pc.ssd.children(parent)}
    d = ["--ssd-dir", str(tmp_path / "ssd"), "--json"]

    def run(*args: str) -> dict:
        capsys.readouterr()
        assert main([*args, *d]) == 0
        return json.loads(capsys.readouterr().out)

    rows = {r["key"]: r for r in run("ls")["rows"]}
    assert len(rows) == 4 and len(tails) == 2
    assert {(rows[k]["num_tokens"], rows[k]["prefix_tokens"]) for k in tails} == {(13, 45)}
    key = sorted(tails)[0]
    shown = run("show", key)
    assert (shown["prefix_tokens"], shown["complete"], len(shown["chain"])) == (45, True, 3)
    assert run("ls", "--chains")["rows"][0]["prefix_tokens"] == 45
    checked = run("verify")
    assert checked["ok"] and checked["num_checked"] == 4 and checked["num_detached"] == 0
    assert main(["gc", "--ssd-dir", str(tmp_path / "ssd")]) == 0
    assert len(run("ls")["rows"]) == 4  # nothing of it is dangling


def test_a_tail_still_queued_for_the_writer_is_found_and_restored(tmp_path, llama):
    from prefixcache.tiers.ssd.tier import SsdTier

    a = prompt(1, 45)
    probe = a + prompt(3, 5)
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        hot_max_bytes=1,
    )
    hold = threading.Event()
    ssd = SsdTier(config, writer_hold=hold)
    with PrefixCache(llama, config, model_id="tiny", tiers=[ssd]) as pc:
        try:
            pc.store(a, finished(llama, a))
            parent = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)[1]
            assert ssd.index.children(parent) == []  # nothing written yet
            assert [m.num_tokens for m in ssd.children(parent)] == [13]
            cache, num_cached = pc.fetch(probe)
            assert num_cached == 45
            want = reference(llama, probe, 45)
            assert max_diff(continued(llama, cache, probe[45:]), want) == 0.0
        finally:
            hold.set()
        pc.flush()
        assert [m.num_tokens for m in ssd.children(parent)] == [13]
        assert len(ssd.index.children(parent)) == 1 and ssd.writer.pending_children(parent) == []


def test_an_unreadable_tail_entry_is_quarantined_by_the_lookup_and_stored_again(tmp_path, llama):
    import lmdb

    a = prompt(1, 45)
    probe = a + prompt(3, 5)
    with ssd_pc(llama, tmp_path, hot_max_bytes=1) as pc:
        pc.store(a, finished(llama, a))
        pc.flush()
        parent = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)[1]
        (tail,) = pc.ssd.children(parent)
    env = lmdb.open(str(tmp_path / "ssd" / "index"), max_dbs=16)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(tail.key))
        value[40] ^= 0xFF  # the entry fails its own checksum
        txn.put(tail.key, bytes(value))
    env.close()
    with ssd_pc(llama, tmp_path, hot_max_bytes=1) as pc:
        assert pc.fetch(probe)[1] == 32  # the tail is not served ...
        assert pc.stats()["ssd"]["num_corrupt"] == 1  # ... it is counted and dropped
        assert pc.ssd.children(parent) == []
        pc.store(a, finished(llama, a))  # and stored again
        pc.flush()
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 45
        want = reference(llama, probe, 45)
        assert max_diff(continued(llama, cache, probe[45:]), want) == 0.0
