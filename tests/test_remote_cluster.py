"""The remote tier on a real Redis Cluster (3 masters, loopback ports).

Blocks spread over the shards by hash slot; a block's keys share its hash tag
(one shard, one pipeline); a chain lookup is one round trip per shard; a dead
master is a miss for its blocks only; two host processes share the cluster,
restore each other's chains and tails exactly, and follow a failover (a
replica promoted) without a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prompt
from redis_cluster import RedisCluster, free_cluster_port
from ssd_child import ROOT, block_key, check_block, make_block
from test_remote_tier import count_round_trips, load_all, stored

from prefixcache.config import CacheConfig
from prefixcache.errors import MissReason
from prefixcache.tiers.remote import RemoteTier

BLOCK = 16
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 masters, no replicas: shared by this module's tests that kill nothing."""
    c = RedisCluster(str(tmp_path_factory.mktemp("cluster")))
    yield c
    c.stop()


def tier_on(url: str, **changes) -> RemoteTier:
    config = CacheConfig(remote_url=url, remote_breaker_failures=1, remote_breaker_ms=300)
    return RemoteTier(config.replace(**changes))


def test_blocks_spread_over_shards_and_a_lookup_is_one_round_trip_per_shard(cluster):
    cluster.flush()
    tier = tier_on(cluster.url)
    blocks = [make_block(41, i, scale=3000) for i in range(9)]  # 2 parts each (seed: all 3 shards)
    keys = stored(tier, blocks)
    names = tier.names
    owners = [cluster.master_of(names.meta(k)) for k in keys]
    assert len(set(owners)) == 3  # the chain is spread over every master
    for key, owner in zip(keys, owners, strict=True):  # a block's keys on one shard
        assert {cluster.master_of(names.part(key, n)) for n in range(2)} == {owner}
        assert cluster.master_of(names.children(key)) == owner
    chain = [*keys, block_key(41, 9)]
    with count_round_trips(tier) as trips:
        metas = tier.held(chain, 0)
    assert [m.key for m in metas] == keys and trips == [3]  # one pipeline per master
    with count_round_trips(tier) as trips:  # the listing's shard; metas came with the chain
        assert [m.key for m in tier.children(keys[4])] == [keys[5]]
    assert trips == [1]
    for block in load_all(tier, keys):
        check_block(block, scale=3000)
    st = tier.stats()
    assert st["num_shards"] == 3 and st["num_loads"] == 9 and st["num_corrupt"] == 0
    tier.close()


def test_a_dead_master_is_a_miss_for_its_blocks_only(tmp_path):
    cluster = RedisCluster(str(tmp_path))
    try:
        tier = tier_on(cluster.url)
        chains = [[make_block(50 + c, i) for i in range(4)] for c in range(6)]
        keyss = [stored(tier, chain) for chain in chains]
        dead = cluster.master_of(tier.names.meta(keyss[0][1]))
        cluster.kill(dead)
        depths = []
        for keys in keyss:
            on_dead = [owner == dead for owner in _owners(tier, keys)]
            depth = on_dead.index(True) if True in on_dead else len(keys)
            depths.append(depth)
            got = load_all(tier, keys)
            assert len([b for b in got if b is not None]) == depth  # up to its first dead block
            for block in got[:depth]:
                check_block(block)
            if depth < len(keys):
                assert tier.miss_reason(keys[depth]) is MissReason.REMOTE_UNAVAILABLE
        assert 4 in depths and min(depths) < 4  # whole chains beside cut ones
        st = tier.stats()
        assert st["num_errors"] >= 1 and st["num_shards_down"] == 1 and st["num_loads"] > 0
        assert st["num_corrupt"] == 0
        tier.close()
    finally:
        cluster.stop()


def _owners(tier: RemoteTier, keys: list[bytes]) -> list[int]:
    """The port of the master each block was written to (read from the tier's map)."""
    return [int(tier.client.shards.peek(tier.names.meta(k)).name.rpartition(":")[2]) for k in keys]


class HostProcess:
    """A host (remote_host.py) in its own process, with its own SSD directory."""

    def __init__(self, url: str, ssd_dir, secret: str | None = None):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
        args = [sys.executable, os.path.join(HERE, "remote_host.py"), url, str(ssd_dir)]
        self.proc = subprocess.Popen(
            [*args, *([secret] if secret else [])],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def run(self, tokens: list[int], *, store: bool = True) -> dict:
        self.proc.stdin.write(json.dumps({"tokens": tokens, "store": store}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        out["logits"] = mx.array(np.frombuffer(bytes.fromhex(out["logits"]), np.float32))[None]
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0


def test_two_hosts_share_a_cluster_and_follow_a_failover(tmp_path, llama):
    cluster = RedisCluster(str(tmp_path / "cluster"), replicas=1)
    a = b = None
    try:
        a = HostProcess(cluster.url, tmp_path / "a")
        b = HostProcess(cluster.url, tmp_path / "b")
        # b restores a's chain exactly (a negative control: another prompt's logits differ)
        tokens = prompt(61, 4 * BLOCK + 5)
        assert a.run(tokens)["cached"] == 0
        got = b.run(tokens)
        assert got["cached"] == 4 * BLOCK + 4 and got["stats"]["remote_block_hits"] == 5
        assert max_diff(got["logits"], live_logits(llama, tokens, 4 * BLOCK + 4)) == 0.0
        other = [*tokens[:3], (tokens[3] + 1) % 512, *tokens[4:]]
        assert max_diff(got["logits"], live_logits(llama, other, 4 * BLOCK + 4)) > 0
        mine = prompt(64, 2 * BLOCK + 3)  # and a restores b's
        assert b.run(mine)["cached"] == 0
        got = a.run(mine)
        assert got["cached"] == 2 * BLOCK + 2  # its tail too (one token is left to prefill)
        assert max_diff(got["logits"], live_logits(llama, mine, 2 * BLOCK + 2)) == 0.0
        # a next turn resumes on the other host to the exact token (a's tail went remote)
        turn = prompt(62, 3 * BLOCK + 5)
        a.run(turn)
        turn2 = [*turn, *prompt(63, 20)]
        got = b.run(turn2)
        assert got["cached"] == 3 * BLOCK + 5  # not 3 * BLOCK: the tail too
        assert max_diff(got["logits"], live_logits(llama, turn2, 3 * BLOCK + 5)) == 0.0
        # chains b has never seen: set 1 fetched while a master is down, set 2 after failover
        sets = [[prompt(70 + 10 * s + i, 4 * BLOCK + 1) for i in range(4)] for s in (0, 1)]
        names = {tuple(t): a.run(t)["names"] for t in sets[0] + sets[1]}
        cluster.replicate()
        dead = cluster.master_of(names[tuple(sets[0][0])][0])
        owners = {t: [cluster.master_of(n) for n in ns] for t, ns in names.items()}
        cluster.kill(dead)
        for t in sets[0]:
            want = next((i for i, o in enumerate(owners[tuple(t)]) if o == dead), 4) * BLOCK
            got = b.run(t, store=False)
            # its blocks before the dead master's first (and maybe a few tokens more that
            # another stored block shares with it: a partial block)
            assert got["cached"] // BLOCK * BLOCK == want
            if got["cached"]:
                assert max_diff(got["logits"], live_logits(llama, t, got["cached"])) == 0.0
        assert got["stats"]["remote"]["num_shards_down"] >= 1
        assert any(dead in owners[tuple(t)] for t in sets[1])
        cluster.wait_failover(dead)  # a replica took over the dead master's slots
        time.sleep(0.35)  # the dead shard's breaker has closed (remote_breaker_ms=300)
        hits = got["stats"]["remote_block_hits"]
        for t in sets[1]:  # every block served again from the cluster, by the promoted replica
            got = b.run(t)
            assert got["cached"] == 4 * BLOCK
            assert got["stats"]["remote_block_hits"] - hits == 4
            hits = got["stats"]["remote_block_hits"]
            assert max_diff(got["logits"], live_logits(llama, t, 4 * BLOCK)) == 0.0
        assert got["stats"]["remote"]["num_slot_map_reads"] >= 2
    finally:
        for host in (a, b):
            if host is not None:
                host.close()
        cluster.stop()


def test_stats_and_gc_of_a_cluster_from_the_cli(cluster, capsys):
    from prefixcache.cli import main

    cluster.flush()
    secret = "a secret of at least 16 characters"
    tier = tier_on(cluster.url, remote_secret=secret)
    tier.note_namespace(ROOT, json.dumps({"model": "m1"}))
    keys = stored(tier, [make_block(44, i) for i in range(6)])
    client = cluster.node(cluster.master_of(tier.names.meta(keys[4])))
    sealed = bytearray(client.get(tier.names.meta(keys[4])))
    sealed[-1] ^= 1  # a byte of the sealed body changed: its MAC fails
    client.set(tier.names.meta(keys[4]), bytes(sealed))
    assert len(tier.held(keys, 0)) == 4 and tier.stats()["num_forged"] == 1
    tier.flush()  # the writer adds the count to the server's record
    assert main(["stats", "--remote-url", cluster.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"] and doc["num_blocks"] == 6 and doc["num_forged"] == 1
    assert [ns["model"] for ns in doc["namespaces"]] == ["m1"]
    assert len(doc["shards"]) == 3
    assert {s["maxmemory_policy"] for s in doc["shards"]} == {"allkeys-lru"}
    assert main(["stats", "--remote-url", cluster.url]) == 0
    text = capsys.readouterr().out
    assert "1 forged" in text and text.count("allkeys-lru") >= 3
    stray = tier.names.meta(keys[5])  # its parts are left over once its meta is gone
    cluster.node(cluster.master_of(stray)).delete(stray)
    old = tier.names.meta(keys[0])[:-1] + "c"  # a children set an older version kept
    cluster.node(cluster.master_of(old)).sadd(old, b"x" * 16)
    assert main(["gc", "--remote-url", cluster.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_blocks"] == 0 and doc["num_stray_keys"] == 2
    assert doc["num_dangling_names"] == 1  # the block whose meta went, in its parent's listing
    assert main(["gc", "--remote-url", cluster.url, "--model", "m1", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_blocks"] == 5 and doc["num_selected"] == 5  # dry run: nothing removed
    assert main(["gc", "--remote-url", cluster.url, "--model", "m1"]) == 0
    assert "removed 5 blocks" in capsys.readouterr().out
    keys_left = [k for p in cluster.masters() for k in cluster.node(p).keys("prefixcache:{*")]
    assert keys_left == []
    tier.close()


def test_remove_deletes_the_servers_keys(cluster):
    cluster.flush()
    tier = tier_on(cluster.url)
    keys = stored(tier, [make_block(45, i, scale=3000) for i in range(3)])
    assert tier.remove(keys[1:]) == 2
    tier.flush()
    assert [m.key for m in tier.held(keys, 0)] == keys[:1]
    for key in keys[1:]:
        port = cluster.master_of(tier.names.meta(key))
        assert not cluster.node(port).exists(tier.names.meta(key), tier.names.part(key, 0))
    assert tier.children(keys[0]) == []  # its name left its parent's set
    assert tier.stats()["num_removed"] == 2
    tier.close()


def test_an_unreachable_cluster_is_a_quick_miss(tmp_path):
    """No node answers: each lookup skips at once, the slot map is asked for again
    only once a breaker time has passed (never on every call)."""
    dead = [f"127.0.0.1:{free_cluster_port()}" for _ in range(2)]
    tier = tier_on("redis+cluster://" + ",".join(dead), remote_breaker_ms=60_000)
    keys = [block_key(46, i) for i in range(3)]
    for _ in range(20):
        assert tier.held(keys, 0) == []
        assert tier.miss_reason(keys[0]) is MissReason.REMOTE_UNAVAILABLE
    st = tier.stats()
    assert st["num_slot_map_reads"] == 1 and st["num_skipped"] >= 20
    tier.put(make_block(46, 0))  # queued (no map yet to tell), then dropped by the writer
    tier.flush()
    st = tier.stats()
    assert st["num_writes"] == 0 and st["num_dropped_writes"] == 1
    tier.close()


def test_tenant_shares_on_a_cluster_evict_across_shards_and_add_up(cluster):
    """The figures live on one shard (one hash tag); the blocks they evict on any."""
    cluster.flush()
    blocks = [replace(make_block(46, i, scale=3000), tenant="a") for i in range(9)]
    tier = tier_on(cluster.url, remote_tenant_caps="a=1G")
    stored(tier, blocks[:1])
    size = tier.tenant_stats()["a"]["nbytes"]
    tier.close()
    cluster.flush()
    tier = tier_on(cluster.url, remote_tenant_caps=f"a={4 * size}")
    for block in blocks:  # one batch each: the oldest goes as each comes
        stored(tier, [block])
    figures = tier.tenant_stats()["a"]
    assert figures["num_blocks"] == 4 and figures["num_cap_evictions"] == 5
    names = tier.names
    owners = {cluster.master_of(names.meta(b.key)) for b in blocks}
    assert len(owners) == 3  # the evicted blocks were on every master
    held = [
        bool(cluster.node(cluster.master_of(names.meta(b.key))).exists(names.meta(b.key)))
        for b in blocks
    ]
    assert held == [False] * 5 + [True] * 4
    tier.close()
