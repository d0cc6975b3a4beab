"""The SSD tier's children near a prompt: a lookup whose prompt diverges inside a
block reads a few of its parent's children, however many traffic left there.

Real LMDB in a tmp dir, the tiny llama; the restore is compared bit-exactly with a
live run chunked alike, with a negative control (another child's tail, restored
the same way, gives other logits).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
from conftest import max_diff, prompt, tiny_model
from test_partial_blocks import continued, finished, reference

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import decode_meta
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiers.ssd.admin.maintenance import reconcile
from prefixcache.tiers.ssd.index import SsdIndex
from prefixcache.tiers.ssd.nearby import DB, NEAREST, complete
from prefixcache.tiers.ssd.tier import SsdTier

BLOCK = 16
SYSTEM = prompt(1, BLOCK)  # one full block: every user turn is a tail under it
NUM_TURNS = 300
V1_INDEX = Path(__file__).parent / "data" / "ssd_v1"  # written by format 1 (no ``nearby``)


def turn(i: int) -> list[int]:
    return SYSTEM + prompt(100 + i, 8)


def ssd_pc(model, tmp_path) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        promote=False,
    )
    return PrefixCache(model, config, model_id="tiny")


def counting(pc, monkeypatch) -> list[bytes]:
    """Keys of the index entries the SSD tier decodes from now on."""
    seen: list[bytes] = []
    decoded = pc.ssd.reads.decoded

    def count(key, raw):
        seen.append(key)
        return decoded(key, raw)

    monkeypatch.setattr(pc.ssd.reads, "decoded", count)
    return seen


def test_a_lookup_decodes_a_few_children_of_hundreds(tmp_path, monkeypatch):
    model = tiny_model("llama")
    with ssd_pc(model, tmp_path) as pc:
        for i in range(NUM_TURNS):
            pc.store(turn(i), finished(model, turn(i)))
        pc.trim_hot(0)  # everything spills to the SSD tier (write_back)
        pc.flush()
        parent = chain_keys(pc.namespace.root_key(), token_bytes(SYSTEM), BLOCK)[0]
        assert len(pc.ssd.children(parent)) == NUM_TURNS  # callers without near: all
        mine = turn(137)
        probe = [*mine[: BLOCK + 5], *prompt(999, 6)]  # diverges inside turn 137's tail
        seen = counting(pc, monkeypatch)
        near = pc.ssd.children(parent, token_bytes(probe[BLOCK:]))
        assert len(seen) <= 2 * NEAREST
        assert token_bytes(mine[BLOCK:]) in {m.tokens for m in near}  # the nearest is read
        seen.clear()
        cache, num_cached = pc.fetch(probe)
        assert num_cached == BLOCK + 5
        assert len(seen) <= 2 * NEAREST + 2  # the children and the chain's block
        want = reference(model, probe, num_cached)
        assert max_diff(continued(model, cache, probe[num_cached:]), want) == 0.0
        # negative control: another turn's tail, cut and restored the same way
        other = turn(138)
        theirs, num_theirs = pc.fetch([*other[: BLOCK + 5], *prompt(998, 6)])
        assert num_theirs == BLOCK + 5
        assert max_diff(continued(model, theirs, probe[num_cached:]), want) > 0.0


def test_an_index_without_the_order_gets_it_when_opened(tmp_path):
    """An index whose ``nearby`` database is empty (written before it existed) is
    rebuilt once when opened to write; nothing stored is lost."""
    model = tiny_model("llama")
    with ssd_pc(model, tmp_path) as pc:
        for i in range(3):
            pc.store(turn(i), finished(model, turn(i)))
        pc.trim_hot(0)
        parent = chain_keys(pc.namespace.root_key(), token_bytes(SYSTEM), BLOCK)[0]
    env = lmdb.open(str(tmp_path / "ssd" / "index"), max_dbs=16, subdir=True)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(DB.encode(), txn=txn), delete=False)
    env.close()
    probe = [*turn(1)[: BLOCK + 3], *prompt(997, 4)]
    with ssd_pc(model, tmp_path) as pc:
        near = pc.ssd.children(parent, token_bytes(probe[BLOCK:]))
        assert token_bytes(turn(1)[BLOCK:]) in {m.tokens for m in near}
        assert len(pc.ssd.children(parent)) == 3
        assert pc.match(probe) == BLOCK + 3


def test_an_index_of_format_1_gets_the_order_when_upgraded(tmp_path):
    """Read-only, a format-1 index (no ``nearby``) lists all children; opened to
    write, it is upgraded and every block is found near its own tokens."""
    path = tmp_path / "ssd"
    shutil.copytree(V1_INDEX, path)
    index = SsdIndex(str(path / "index"), str(path / "blocks"), readonly=True)
    metas = [decode_meta(k, v) for k, v in index.rows()]
    assert len(metas) == 6
    assert all(index.children_near(m.parent, m.tokens) is None for m in metas)
    index.close()
    config = CacheConfig(ssd_dir=str(path), ssd_min_free_bytes=0)
    with SsdTier(config) as tier:
        for meta in metas:
            near = tier.children(meta.parent, meta.tokens)
            assert meta.key in {m.key for m in near}
            assert {m.key for m in near} <= {m.key for m in tier.children(meta.parent)}
        assert reconcile(tier.index) == (0, 0)  # gc rebuilds the order too
        blocks, order = tier.index._db["blocks"], tier.index._db[DB]
        assert tier.index.transact(lambda t: complete(t, blocks, order))
        assert tier.index.remove([metas[0].key]) == 1  # a dropped entry leaves the order
        assert tier.index.transact(lambda t: complete(t, blocks, order))
