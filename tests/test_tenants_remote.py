"""Tenant shares of the remote tier against a real redis-server (``noeviction``): floors
kept under another tenant's flood, caps that evict the tenant's own blocks, refusals
counted, figures right with two writers, nothing on the write path without shares."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path

import pytest
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache
from redis_server import RedisServer
from ssd_child import check_block, make_block
from test_remote_tier import load_all

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.errors import ConfigError
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.remote.names import Names

PREFIX = "prefixcache"
BASE = f"{PREFIX}:{{shares}}:"


@pytest.fixture
def server(tmp_path):
    """A redis-server that never evicts by itself (what remote shares need)."""
    s = RedisServer(str(tmp_path), args=("--maxmemory-policy", "noeviction"))
    yield s
    s.stop()


@pytest.fixture
def open_tier(server):
    """Open remote tiers on ``server``; every one is closed at teardown."""
    tiers: list[RemoteTier] = []

    def opener(**settings) -> RemoteTier:
        tiers.append(RemoteTier(CacheConfig(remote_url=server.url, **settings)))
        return tiers[-1]

    yield opener
    for tier in tiers:
        tier.close()


def owned(seed: int, index: int, tenant: str) -> Block:
    parent = None if index == 0 else make_block(seed, index - 1).key
    return dataclasses.replace(make_block(seed, index, parent=parent), tenant=tenant)


def put(tier: RemoteTier, blocks: list[Block], *, each: bool = False) -> list[Block]:
    """Put ``blocks``: in one batch, or (``each``) one batch per block."""
    for block in blocks:
        assert tier.put(block)
        if each:
            tier.flush()
    tier.flush()
    return blocks


def chain(tenant: str, seed: int, length: int) -> list[Block]:
    return [owned(seed, i, tenant) for i in range(length)]


def on_server(server: RedisServer, blocks: list[Block], prefix: str = PREFIX) -> int:
    """How many of ``blocks`` the server holds (their metas)."""
    r = server.client()
    return sum(bool(r.exists(Names(prefix).meta(b.key))) for b in blocks)


def add_up(tier: RemoteTier, server: RedisServer) -> dict[str, dict[str, int]]:
    """Every tenant: stored = held + evicted + removed; the tenants' bytes add up
    to the server's total, their blocks to the blocks charged and to the metas
    the server holds."""
    figures = tier.tenant_stats()
    for name, f in figures.items():
        assert f["num_stored"] == f["num_blocks"] + f["num_evicted"] + f["num_removed"], name
        assert f["num_cap_evictions"] <= f["num_evicted"], name
    r, base, prefix = server.client(), tier.shares.base, tier.prefix
    assert sum(f["nbytes"] for f in figures.values()) == int(r.get(base + "total") or 0)
    held = sum(f["num_blocks"] for f in figures.values())
    assert held == r.hlen(base + "owner")
    assert held == len(list(r.scan_iter(match=f"{prefix}:{{*}}:m")))
    return figures


@pytest.fixture
def size(open_tier) -> int:
    """Bytes the remote tier charges for one block of ssd_child (meta + parts)."""
    tier = open_tier(remote_prefix="measure", remote_tenant_caps="x=1M")
    put(tier, [owned(99, 0, "x")])
    return tier.tenant_stats()["x"]["nbytes"]


def test_a_floor_keeps_b_while_a_floods_and_without_it_b_gives(open_tier, server, size):
    def flood(prefix: str, floors: str) -> tuple[int, dict]:
        tier = open_tier(
            remote_prefix=prefix, remote_max_bytes=14 * size, remote_tenant_floors=floors
        )
        b = put(tier, chain("b", 1, 10))
        for seed in range(20):  # a: one-off prompts of 2 blocks, written store by store
            put(tier, chain("a", 100 + seed, 2))
        figures = add_up(tier, server)
        assert sum(f["nbytes"] for f in figures.values()) <= 14 * size
        return on_server(server, b, prefix), figures

    kept, figures = flood(PREFIX, f"b={10 * size}")
    assert kept == 10 and figures["b"]["num_evicted"] == 0
    assert figures["a"]["num_blocks"] == 4 and figures["a"]["num_evicted"] == 36
    assert figures["a"]["num_refused"] == 0 and figures["b"]["floor_bytes"] == 10 * size
    # negative control: shares on, no floor for b: the largest tenant gives, b too
    kept, figures = flood("bare", f"z={size}")
    assert kept == 7 and figures["b"]["num_evicted"] == 3


def test_a_floored_tenant_still_restores_its_blocks_bit_exactly(open_tier, server, size):
    tier = open_tier(remote_max_bytes=6 * size, remote_tenant_floors=f"b={3 * size}")
    b = put(tier, chain("b", 2, 3))
    for seed in range(6):
        put(tier, chain("a", 200 + seed, 2))
    got = load_all(tier, [x.key for x in b])
    assert len(got) == 3
    for block in got:
        check_block(block)
    assert on_server(server, b) == 3


def test_a_cap_evicts_a_s_own_blocks_and_a_block_over_it_is_refused(open_tier, server, size):
    tier = open_tier(remote_tenant_caps=f"a={3 * size},tiny={size // 2}")
    b = put(tier, chain("b", 3, 4))
    a = put(tier, chain("a", 4, 5), each=True)
    figures = add_up(tier, server)
    assert figures["a"]["num_blocks"] == 3 and figures["a"]["num_cap_evictions"] == 2
    assert on_server(server, a) == 3 and on_server(server, a[2:]) == 3  # the oldest went
    assert on_server(server, b) == 4 and figures["b"]["num_evicted"] == 0
    in_one = put(tier, chain("a", 5, 5))  # one batch: its first two evicted before sent
    assert on_server(server, in_one) == 3 and on_server(server, a) == 0
    tiny = put(tier, chain("tiny", 6, 2))
    figures = add_up(tier, server)
    assert figures["tiny"]["num_refused"] == 2 and figures["tiny"]["num_stored"] == 0
    assert on_server(server, tiny) == 0
    stats = tier.stats()
    assert stats["num_no_room"] == 2 and stats["num_dropped_writes"] == 0
    assert figures["a"]["num_stored"] == 10 and figures["a"]["num_cap_evictions"] == 7


def test_in_one_batch_an_older_chain_goes_before_a_newer_one(open_tier, server, size):
    tier = open_tier(remote_tenant_caps=f"a={3 * size}")
    older, newer = chain("a", 16, 3), chain("a", 17, 3)
    put(tier, [*older, *newer])  # one batch, one reserve: two uses in order
    assert on_server(server, newer) == 3 and on_server(server, older) == 0


def test_a_restored_block_is_used_and_goes_after_the_others(open_tier, server, size):
    tier = open_tier(remote_tenant_caps=f"a={3 * size}")
    first = put(tier, [owned(7, 0, "a")])
    others = put(tier, [owned(8, 0, "a"), owned(9, 0, "a")], each=True)
    assert len(load_all(tier, [first[0].key])) == 1  # the oldest, used now
    tier.flush()  # the use reaches the server with the writer's next round
    put(tier, [owned(10, 0, "a")])
    assert on_server(server, first) == 1 and on_server(server, others) == 1
    assert on_server(server, others[:1]) == 0  # the least recently used went


def test_a_block_the_shares_evicted_is_written_again_when_put_again(open_tier, server, size):
    tier = open_tier(remote_tenant_caps=f"a={2 * size}")
    blocks = [owned(19 + i, 0, "a") for i in range(3)]
    put(tier, blocks, each=True)
    assert on_server(server, blocks[:1]) == 0 and not tier.contains(blocks[0].key)
    put(tier, blocks[:1])  # known no more: written again, the oldest of the others goes
    assert on_server(server, blocks) == 2 and on_server(server, blocks[:1]) == 1
    assert add_up(tier, server)["a"]["num_stored"] == 4


def test_a_block_another_host_evicts_between_reserve_and_write_leaves_no_keys(
    open_tier, server, size
):
    mine = open_tier(remote_tenant_caps=f"a={10 * size}")
    other = open_tier(remote_tenant_caps=f"a={size}")  # its cap: one block of a's
    x, y = owned(30, 0, "a"), owned(31, 0, "a")
    reserve = mine.shares.reserve

    def then_the_other_host_writes(blocks):  # the real reserve, then a real second writer
        got = reserve(blocks)
        put(other, [y])  # over its cap: evicts x, whose keys are not written yet
        return got

    mine.shares.reserve = then_the_other_host_writes
    put(mine, [x])  # x's keys land after its eviction: this host deletes them
    assert on_server(server, [x]) == 0 and on_server(server, [y]) == 1
    figures = add_up(mine, server)  # the metas on the server are what is charged
    assert figures["a"]["num_blocks"] == 1 and figures["a"]["num_cap_evictions"] == 1
    assert not mine.contains(x.key)  # forgotten: a later put writes it again


def test_remove_uncharges_the_blocks_as_removed(open_tier, server, size):
    tier = open_tier(remote_tenant_caps=f"a={8 * size}")
    a = put(tier, chain("a", 11, 4))
    assert tier.remove([x.key for x in a[2:]]) == 2
    tier.flush()
    figures = add_up(tier, server)
    assert figures["a"]["num_removed"] == 2 and figures["a"]["nbytes"] == 2 * size


def stored(pc: PrefixCache, model, tokens: list[int], tenant: str) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    pc.store(tokens, cache, tenant=tenant)


def remote_of(pc: PrefixCache) -> RemoteTier:
    tier = pc.tiers.named("remote")
    assert isinstance(tier, RemoteTier)
    return tier


def test_two_hosts_writing_at_once_keep_one_right_set_of_figures(tmp_path, llama, server):
    shares = {"remote_max_bytes": 96 << 10, "remote_tenant_floors": "b=32K"}

    def host(name: str) -> PrefixCache:
        config = CacheConfig(
            block_size=16,
            hot_max_bytes=16 << 10,
            ssd_dir=str(tmp_path / name),
            ssd_min_free_bytes=0,
            remote_url=server.url,
            **shares,
        )
        return PrefixCache(llama, config, model_id="t")

    hosts = [host("one"), host("two")]
    go = threading.Barrier(2)

    def run(pc: PrefixCache, first: int) -> None:
        go.wait()
        for i in range(12):  # each host stores for both tenants, interleaved
            stored(pc, llama, prompt(first + i, 48), "a" if i % 3 else "b")
            pc.flush()

    threads = [threading.Thread(target=run, args=(pc, 300 + 100 * n)) for n, pc in enumerate(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        figures = add_up(remote_of(hosts[0]), server)
        assert figures == add_up(remote_of(hosts[1]), server)
        b, a = figures["b"], figures["a"]
        assert a["num_evicted"] > 0 and b["nbytes"] >= 32 << 10  # b keeps its floor
        assert a["num_refused"] == b["num_refused"] == 0
        assert a["num_stored"] + b["num_stored"] == 24 * 3  # 3 blocks a prompt, all new
        assert a["nbytes"] + b["nbytes"] <= 96 << 10
        assert hosts[1].stats()["tenants"]["b"]["remote"] == b
    finally:
        for pc in hosts:
            pc.close()


def test_without_shares_nothing_is_charged_and_no_script_runs(open_tier, server):
    tier = open_tier()
    put(tier, chain("", 12, 3))
    r = server.client()
    assert on_server(server, chain("", 12, 3)) == 3
    assert list(r.scan_iter(match=BASE + "*")) == []
    calls = r.info("commandstats")
    assert not any(name.startswith("cmdstat_eval") for name in calls)
    assert tier.tenant_stats() == {} and not tier.charges_tenants  # stats() lists no remote
    # negative control: with a cap the scripts run and the figures are kept
    capped = open_tier(remote_prefix="capped", remote_tenant_caps="a=1M")
    put(capped, chain("a", 13, 1))
    assert any(name.startswith("cmdstat_eval") for name in r.info("commandstats"))
    assert capped.charges_tenants


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"remote_tenant_floors": "b"}, "'b'"),
        ({"remote_tenant_caps": "a=x"}, "'a=x'"),
        ({"remote_tenant_floors": "b=2M"}, "tenant 'b' floor 2097152 is above remote_max_bytes"),
        ({"remote_tenant_floors": "b=600K,c=600K"}, "sums to 1228800"),
        ({"remote_tenant_floors": "b=64K", "remote_tenant_caps": "b=32K"}, "tenant 'b' cap"),
    ],
)
def test_bad_remote_shares_are_refused_naming_the_value(changes, named):
    with pytest.raises(ConfigError, match=named) as err:
        CacheConfig(remote_max_bytes=1 << 20, **changes)
    assert err.value.field in changes
    assert "\n" not in str(err.value)


def test_a_remote_floor_without_a_remote_budget_is_refused():
    with pytest.raises(ConfigError, match="above remote_max_bytes=0"):
        CacheConfig(remote_url="redis://127.0.0.1:1", remote_tenant_floors="b=1K")


# what remote shares need beyond the ACL of docs/remote.md (the scripts and the
# commands they run)
SHARES_ACL = (
    "+evalsha",
    "+eval",
    "+hget",
    "+hset",
    "+hdel",
    "+hmget",
    "+smembers",
    "+sadd",
    "+zscore",
    "+zincrby",
    "+zrevrange",
    "+incr",
    "+incrby",
    "+decrby",
)


def test_a_user_with_the_documented_acl_keeps_shares_and_one_without_stores_nothing(server, size):
    from test_remote_auth import CACHE_ACL

    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "shares", "on", ">pw", *CACHE_ACL, *SHARES_ACL)
    admin.execute_command("ACL", "SETUSER", "plain", "on", ">pw", *CACHE_ACL)
    port = server.port
    for user, written in (("shares", 3), ("plain", 0)):  # plain: scripts refused, none written
        url = f"redis://{user}:pw@127.0.0.1:{port}"
        config = CacheConfig(remote_url=url, remote_tenant_caps=f"a={2 * size}")
        tier = RemoteTier(config)
        try:
            blocks = chain("a", 14, 3)
            for block in blocks:  # one batch each: the third evicts the first
                tier.put(block)  # plain: False once the refused script turned the tier off
                tier.flush()
            assert tier.stats()["num_writes"] == written
            assert tier.stats()["off"] == (not written)  # "may not use ... (ACL)", logged once
            assert on_server(server, blocks) == min(written, 2)
            if written:
                assert tier.stats()["num_errors"] == 0
                figures = add_up(tier, server)["a"]
                assert figures["num_blocks"] == 2 and figures["num_cap_evictions"] == 1
        finally:
            tier.close()
        admin.flushall()


def test_stats_cli_and_prometheus_show_the_remote_figures_per_tenant(
    tmp_path, llama, server, capsys
):
    from prefixcache.cli import main
    from prefixcache.prometheus import prometheus_text

    config = CacheConfig(
        block_size=16,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        remote_url=server.url,
        remote_tenant_caps="a=24K",
    )
    with PrefixCache(llama, config, model_id="t") as pc:
        for i in range(4):
            stored(pc, llama, prompt(500 + i, 48), "a")
            pc.flush()
        live = pc.stats()
    a = live["tenants"]["a"]["remote"]
    assert a["num_cap_evictions"] > 0 and a["nbytes"] <= 24 << 10 and a["cap_bytes"] == 24 << 10
    series = 'prefixcache_tenant_cap_evictions_total{tenant="a",tier="remote"}'
    line = f"{series} {a['num_cap_evictions']}"
    assert line in prometheus_text(live).splitlines()
    assert main(["stats", "--remote-url", server.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tenants"]["a"] == {k: v for k, v in a.items() if "_bytes" not in k}
    assert doc["num_blocks"] == a["num_blocks"]  # what the server holds is what is charged
    assert main(["stats", "--remote-url", server.url]) == 0
    assert "remote tier per tenant (blocks):" in capsys.readouterr().out


def test_gc_uncharges_what_it_removes(open_tier, server):
    from prefixcache.tiers.remote.gc import plan_gc, run_gc

    tier = open_tier(remote_tenant_caps="a=1M")
    put(tier, chain("a", 15, 3))
    plan = plan_gc(tier.client, Names(PREFIX), model=None, older_than=-1.0)  # every block
    assert run_gc(tier.client, Names(PREFIX), plan) == 3
    figures = add_up(tier, server)
    assert figures["a"]["num_removed"] == 3 and figures["a"]["num_blocks"] == 0


def test_bench_remote_shares_floors_match_running_alone_and_lose_nothing(server):
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    import bench_remote_shares

    argv = ["--remote", "256K", "--hot", "16K", "--rounds", "2", "--flood", "4"]
    args = bench_remote_shares.setup_arg_parser().parse_args([*argv, "--system-tokens", "32"])
    rows = {row["system"]: row for row in bench_remote_shares.fairness(args, server)}
    alone = rows["alone"]["B hit %"], rows["alone"]["C hit %"]
    assert float(alone[0]) > 0
    for system in ("floors", "A capped"):
        assert (rows[system]["B hit %"], rows[system]["C hit %"]) == alone
        assert rows[system]["lost"] == "0" and int(rows[system]["evicted"]) > 0
    # "no shares" is the server's LRU, which samples keys at random: not asserted


def test_a_server_that_evicts_by_itself_is_named_once(redis_server, server, caplog):
    caplog.set_level(logging.WARNING, logger="prefixcache.tiers.remote")  # the CLI quiets it
    for s, warned in ((redis_server, 1), (server, 0)):  # allkeys-lru, then noeviction
        caplog.clear()
        tier = RemoteTier(CacheConfig(remote_url=s.url, remote_tenant_caps="a=1M"))
        try:
            put(tier, chain("a", 32, 2), each=True)
        finally:
            tier.close()
        lines = [r.getMessage() for r in caplog.records if "noeviction" in r.getMessage()]
        assert len(lines) == warned
        assert all("allkeys-lru" in line for line in lines)
