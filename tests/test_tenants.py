"""Tenant shares of the hot tier: floors kept under another tenant's flood, caps that
evict the tenant's own blocks, counts that add up, defaults unchanged, bad input."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.errors import ConfigError
from prefixcache.shares_config import tier_shares
from prefixcache.tiers.hot.tenants import TenantShares, tenant_shares
from prefixcache.tiers.hot.tier import HotTier

ROOT = b"r" * 16


def block(name: str, parent: bytes = ROOT, nbytes: int = 100) -> Block:
    key = name.encode().ljust(16, b".")
    arrays = {"0.keys": mx.zeros((nbytes // 4,), mx.float32)}
    return Block.make(key, parent, ROOT, 0, b"", arrays)


def put(hot: HotTier, tenant: str, name: str, parent: bytes = ROOT) -> Block:
    b = block(name, parent)
    if hot.tenants is not None:
        with hot.tenants.charging(tenant):
            hot.put(b)
    else:
        hot.put(b)
    return b


def flood(hot: HotTier, num: int, tenant: str = "a") -> None:
    for i in range(num):
        put(hot, tenant, f"{tenant}{i}")


def held(hot: HotTier, blocks: list[Block]) -> int:
    return sum(b.key in hot for b in blocks)


def totals_add_up(hot: HotTier) -> None:
    """Every tenant: stored = held + evicted + removed; the tier's own counters agree."""
    assert hot.tenants is not None
    figures = hot.tenants.stats()
    for f in figures.values():
        assert f["num_stored"] == f["num_blocks"] + f["num_evicted"] + f["num_removed"]
    assert sum(f["num_evicted"] for f in figures.values()) == hot.num_evictions
    assert sum(f["nbytes"] for f in figures.values()) == hot.nbytes
    assert sum(f["num_blocks"] for f in figures.values()) == len(hot)


def test_a_floor_keeps_b_under_a_flood_and_without_it_b_is_gone():
    shares = TenantShares({"b": 300}, {})
    hot = HotTier(1000, tenants=shares, policy="lru")
    mine = [put(hot, "b", f"b{i}") for i in range(3)]
    flood(hot, 50)
    assert held(hot, mine) == 3
    assert hot.nbytes <= 1000
    totals_add_up(hot)
    bare = HotTier(1000, policy="lru")  # negative control: no shares
    mine = [put(bare, "b", f"b{i}") for i in range(3)]
    flood(bare, 50)
    assert held(bare, mine) == 0


def test_eviction_takes_from_the_tenant_most_over_its_floor_first():
    hot = HotTier(1000, tenants=TenantShares({"b": 200}, {}))
    for i in range(4):
        put(hot, "b", f"b{i}")  # b: 200 over its floor
    for i in range(6):
        put(hot, "d", f"d{i}")  # d: 600 over (floor 0); the tier is full
    put(hot, "b", "b4")  # over budget: d is the most over, so d gives
    figures = hot.tenants.stats()
    assert figures["d"]["num_evicted"] == 1 and figures["b"]["num_evicted"] == 0
    assert block("d0").key not in hot  # d's least recently used
    totals_add_up(hot)


def test_a_tenant_at_its_floor_loses_nothing_even_to_its_own_neighbours_recency():
    hot = HotTier(500, tenants=TenantShares({"b": 200, "c": 200}, {}))
    b = [put(hot, "b", f"b{i}") for i in range(2)]
    c = [put(hot, "c", f"c{i}") for i in range(2)]
    for i in range(20):
        put(hot, "a", f"a{i}")
        hot.touch([c[0].key, c[1].key])  # c used all the time, b never again
    assert held(hot, b) == 2 and held(hot, c) == 2
    assert hot.tenants.stats()["a"]["num_blocks"] == 1


def test_a_cap_makes_a_evict_its_own_blocks_and_b_keeps_its():
    shares = TenantShares({}, {"a": 300})
    hot = HotTier(10_000, tenants=shares)
    mine = [put(hot, "b", f"b{i}") for i in range(2)]
    flood(hot, 10)
    figures = shares.stats()
    assert figures["a"]["num_blocks"] == 3 and figures["a"]["nbytes"] == 300
    assert figures["a"]["num_cap_evictions"] == 7 == figures["a"]["num_evicted"]
    assert held(hot, mine) == 2 and figures["b"]["num_evicted"] == 0
    assert [block(f"a{i}").key in hot for i in range(10)] == [False] * 7 + [True] * 3
    totals_add_up(hot)
    bare = HotTier(10_000)  # negative control: no cap, all ten stay
    flood(bare, 10)
    assert len(bare) == 10


def test_a_block_larger_than_its_tenants_cap_is_refused_and_counted():
    shares = TenantShares({}, {"a": 50})
    hot = HotTier(10_000, tenants=shares)
    assert hot.put(block("big"))  # the default tenant: no cap
    with shares.charging("a"):
        assert not hot.put(block("a-big"))
    assert block("a-big").key not in hot
    assert shares.stats()["a"]["num_refused"] == 1
    totals_add_up(hot)


def test_a_cap_keeps_pinned_blocks_and_evicts_the_new_one_last():
    shares = TenantShares({}, {"a": 200})
    hot = HotTier(10_000, tenants=shares)
    first = put(hot, "a", "a0")
    hot.pins.add([first.key], float("inf"))
    put(hot, "a", "a1")
    put(hot, "a", "a2")  # over the cap: a1 goes (a0 is pinned, a2 is the new one)
    assert first.key in hot and block("a1").key not in hot and block("a2").key in hot


def test_counts_add_up_under_random_traffic_with_pins_removals_and_chains():
    rng = random.Random(7)
    shares = TenantShares({"b": 400, "c": 300}, {"a": 300, "c": 800})
    hot = HotTier(2000, tenants=shares, policy="lru")
    names: list[Block] = []
    for step in range(2000):
        op = rng.random()
        tenant = rng.choice("abcd")
        if op < 0.6 or not names:
            parent = rng.choice(names).key if names and rng.random() < 0.5 else ROOT
            names.append(put(hot, tenant, f"{tenant}{step}", parent if parent in hot else ROOT))
        elif op < 0.8:
            hot.touch([rng.choice(names).key])
        elif op < 0.9:
            hot.remove([rng.choice(names).key])
        else:
            key = rng.choice(names).key
            hot.pins.add([key], float("inf")) if rng.random() < 0.5 else hot.pins.remove([key])
        assert hot.nbytes <= 2000 or hot.pinned_nbytes() > 0
        totals_add_up(hot)
    figures = shares.stats()
    assert figures["a"]["num_cap_evictions"] > 0 and figures["d"]["num_evicted"] > 0
    assert figures["b"]["num_removed"] > 0


def test_a_block_that_comes_back_is_charged_to_its_owner_again():
    shares = TenantShares({}, {"b": 1000})
    hot = HotTier(1000, tenants=shares)
    b0 = put(hot, "b", "b0")
    hot.remove([b0.key])
    hot.put(b0)  # a promotion: no store under way
    assert shares.stats()["b"]["num_blocks"] == 1
    assert shares.stats().get("", {"num_blocks": 0})["num_blocks"] == 0


def test_defaults_change_nothing():
    assert tenant_shares({}, {}) is None
    model = tiny_model("llama")
    with PrefixCache(model, CacheConfig(hot_cache_only=True), model_id="t") as pc:
        assert pc.hot.tenants is None
        tokens = prompt(0, 40)
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        pc.store(tokens, cache, tenant="b")  # a tenant given with no shares: nothing charged
        assert "tenants" not in pc.stats()
        with pytest.raises(ValueError, match="unknown tenant 'b'"):
            pc.tenant_stats("b")


# -- through the library: who is charged ----------------------------------------------


def stored(pc: PrefixCache, model, tokens: list[int], **options) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    pc.store(tokens, cache, **options)


def tenants_config(**changes) -> CacheConfig:
    base = {"block_size": 16, "hot_cache_only": True, "hot_max_bytes": 64 << 10}
    return CacheConfig(**(base | changes))


def test_a_store_is_charged_to_its_tenant_then_session_owner_then_salt():
    model = tiny_model("llama")
    config = tenants_config(hot_tenant_floors="b=16K", hot_tenant_caps="s=64K")
    with PrefixCache(model, config, model_id="t") as pc:
        pc.begin_session("chat", tenant="owner")
        stored(pc, model, prompt(1, 32), tenant="b", session="chat")  # named: b
        stored(pc, model, prompt(2, 32), session="chat")  # the session's owner
        stored(pc, model, prompt(3, 32), extra={"cache_salt": "s"})  # its salt
        stored(pc, model, prompt(4, 32))  # none: the default tenant
        figures = pc.stats()["tenants"]
        assert {n: f["hot"]["num_blocks"] for n, f in figures.items()} == {
            "": 2,
            "b": 2,
            "owner": 2,
            "s": 2,
        }
        assert pc.tenant_stats("owner")["hot"]["nbytes"] == figures["owner"]["hot"]["nbytes"]
        assert pc.end_session("chat") == 4  # both its stores' blocks, whoever was charged
        figures = pc.stats()["tenants"]
        assert figures["b"]["hot"]["num_removed"] == 2 == figures["owner"]["hot"]["num_removed"]
        with pytest.raises(ValueError, match="unknown tenant 'zz'"):
            pc.tenant_stats("zz")
        pc.begin_session("idle", tenant="x")  # begun, never stored: ends with nothing
        assert pc.end_session("idle") == 0
        with pytest.raises(ValueError, match="tenant must be 1 to 256"):
            pc.begin_session("other", tenant="")


def test_a_block_shared_by_two_tenants_is_charged_once_to_its_first_owner():
    model = tiny_model("llama")
    with PrefixCache(model, tenants_config(hot_tenant_floors="b=16K"), model_id="t") as pc:
        system = prompt(5, 32)
        stored(pc, model, system, tenant="b")
        stored(pc, model, [*system, *prompt(6, 16)], tenant="c")  # walks b's two blocks
        figures = pc.stats()["tenants"]
        assert figures["b"]["hot"]["num_blocks"] == 2
        assert figures["c"]["hot"]["num_blocks"] == 1  # only its own new block
        assert sum(f["hot"]["nbytes"] for f in figures.values()) == pc.stats()["hot"]["nbytes"]


def test_floors_keep_b_s_system_prompt_under_a_s_flood_through_the_library():
    model = tiny_model("llama")
    system = prompt(7, 32)

    def b_hits_after_flood(config: CacheConfig) -> int:
        with PrefixCache(model, config, model_id="t") as pc:
            stored(pc, model, system, tenant="b")
            for i in range(24):  # a: 24 one-off prompts of 48 tokens, 3x the budget
                stored(pc, model, prompt(100 + i, 48), tenant="a")
            return pc.match([*system, 1, 2, 3], extra=None)

    assert b_hits_after_flood(tenants_config(hot_tenant_floors="b=16K")) == 32
    assert b_hits_after_flood(tenants_config()) == 0  # negative control: no floor


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hot_tenant_floors": "b"}, "'b'"),
        ({"hot_tenant_floors": "b=lots"}, "'b=lots'"),
        ({"hot_tenant_floors": "=5M"}, "'=5M'"),
        ({"hot_tenant_floors": "b=1K,b=2K"}, "'b=2K'"),
        ({"hot_tenant_caps": "b=-1K"}, "'b=-1K'"),
        ({"hot_tenant_floors": "b=128K"}, "tenant 'b' floor 131072"),
        ({"hot_tenant_floors": "b=40K,c=40K"}, "sums to 81920"),
        ({"hot_tenant_floors": "b=16K", "hot_tenant_caps": "b=8K"}, "tenant 'b' cap 8192"),
    ],
)
def test_bad_shares_are_refused_naming_the_value(changes, named):
    with pytest.raises(ConfigError, match=named) as err:
        tenants_config(**changes)
    assert err.value.field in changes
    assert "\n" not in str(err.value)


def test_shares_read_from_the_environment_and_a_bad_variable_is_named():
    env = {"PREFIXCACHE_HOT_TENANT_FLOORS": "b=1M, c=2M", "PREFIXCACHE_HOT_TENANT_CAPS": "a=1G"}
    config = CacheConfig.from_env(env)
    assert tier_shares(config, "hot") == ({"b": 1 << 20, "c": 2 << 20}, {"a": 1 << 30})
    with pytest.raises(ConfigError, match="PREFIXCACHE_HOT_TENANT_FLOORS='b=9T'"):
        CacheConfig.from_env({"PREFIXCACHE_HOT_TENANT_FLOORS": "b=9T"})


def test_a_bad_tenant_name_is_refused_and_nothing_stored_is_lost():
    model = tiny_model("llama")
    with PrefixCache(model, tenants_config(hot_tenant_floors="b=16K"), model_id="t") as pc:
        stored(pc, model, prompt(8, 32), tenant="b")
        before = pc.stats()["tenants"]
        for bad in ("", 7):
            with pytest.raises((ValueError, TypeError), match=repr(bad)):
                stored(pc, model, prompt(9, 32), tenant=bad)
        with pytest.raises(ValueError, match="unknown tenant"):
            pc.tenant_stats("nobody")
        assert pc.stats()["tenants"] == before
        assert pc.match(prompt(8, 32)) == 31


def test_prometheus_text_has_every_tenant_figure_labelled():
    from prefixcache.prometheus import prometheus_text

    model = tiny_model("llama")
    config = tenants_config(hot_tenant_floors="b=16K", hot_tenant_caps='q"x=32K')
    with PrefixCache(model, config, model_id="t") as pc:
        stored(pc, model, prompt(10, 32), tenant="b")
        text = prometheus_text(pc.stats())
    assert 'prefixcache_tenant_blocks{tenant="b",tier="hot"} 2' in text
    assert 'prefixcache_tenant_floor_bytes{tenant="b",tier="hot"} 16384' in text
    assert 'prefixcache_tenant_cap_bytes{tenant="q\\"x",tier="hot"} 32768' in text
    assert "# TYPE prefixcache_tenant_evicted_total counter" in text
    assert 'prefixcache_tenant_stored_total{tenant="b",tier="hot"} 2' in text
    for key in ("cap_evictions", "removed", "refused"):
        assert f'prefixcache_tenant_{key}_total{{tenant="b",tier="hot"}} 0' in text


def test_bench_tenants_floors_match_running_alone_and_lose_nothing():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_tenants

    args = bench_tenants.setup_arg_parser().parse_args(
        ["--hot", "64K", "--rounds", "3", "--flood", "4", "--system-tokens", "32"]
    )
    model = tiny_model("llama")
    trace = bench_tenants.make_trace(args, 8192)
    base = {"block_size": 16, "hot_cache_only": True, "hot_max_bytes": args.hot}
    alone = [r for r in trace if r.tenant != "a"]
    run = bench_tenants.run
    solo = run(model, alone, CacheConfig(**base), "alone")
    bare = run(model, trace, CacheConfig(**base), "no shares")
    fair = run(model, trace, CacheConfig(**base, hot_tenant_floors="b=16K,c=16K"), "floors")
    assert fair.shares["b"].percent == solo.shares["b"].percent > 0
    assert bare.shares["b"].percent < solo.shares["b"].percent  # the control: A's flood
    assert fair.counts["lost"] == 0 == fair.counts["unmatched"]
    assert fair.counts["num_evicted"] > 0


def test_prefixcache_stats_shows_the_saved_counters_per_tenant(tmp_path):
    from test_cli import cli, cli_all

    model = tiny_model("llama")
    ssd = str(tmp_path / "ssd")
    config = CacheConfig(
        block_size=16, ssd_dir=ssd, hot_max_bytes=64 << 10, hot_tenant_caps="a=16K"
    )
    with PrefixCache(model, config, model_id="t") as pc:
        stored(pc, model, prompt(11, 32), tenant="b")
        for i in range(4):
            stored(pc, model, prompt(20 + i, 32), tenant="a")  # a's cap: 2 blocks held
        live = pc.stats()["tenants"]
    doc, only_b, text = cli_all(
        ("stats", "--ssd-dir", ssd, "--json"),
        ("stats", "--ssd-dir", ssd, "--tenant", "b", "--json"),
        ("stats", "--ssd-dir", ssd),
    )
    for name in ("a", "b"):
        for key in ("num_stored", "num_evicted", "num_cap_evictions", "num_refused"):
            assert doc["tenants"][name][key] == live[name]["hot"][key], (name, key)
    assert doc["tenants"]["a"]["num_cap_evictions"] == 6
    assert only_b["tenants"].keys() == {"b"}
    assert "hot tier per tenant" in text and "'a'" in text
    err = cli("stats", "--ssd-dir", ssd, "--tenant", "nobody", code=2)
    assert err.strip().splitlines() == [
        "prefixcache stats: --tenant 'nobody': no counters of that tenant ('a', 'b')"
    ]


def test_a_trim_below_the_floors_still_frees_the_bytes_largest_tenant_first():
    shares = TenantShares({"b": 400, "c": 300}, {})
    hot = HotTier(1000, tenants=shares)
    b = [put(hot, "b", f"b{i}") for i in range(4)]
    c = [put(hot, "c", f"c{i}") for i in range(3)]
    hot.pins.add([c[0].key], float("inf"))
    assert hot.evict_to(500) == 2  # at the floors (700): b, the largest, gives first
    assert held(hot, b) == 2 and held(hot, c) == 3
    hot.evict_to(0)
    assert [x.key for x in [*b, *c] if x.key in hot] == [c[0].key]  # only the pinned block
    totals_add_up(hot)


def test_the_policys_refusals_are_counted_per_tenant():
    shares = TenantShares({"b": 300}, {})
    hot = HotTier(500, tenants=shares, policy="frequency")
    for i in range(5):
        put(hot, "b", f"b{i}")
        hot.touch([block(f"b{i}").key])  # used twice: worth more than a one-off
    flood(hot, 20)  # a's one-off blocks are not worth b's: refused
    figures = shares.stats()
    assert figures["a"]["num_refused"] == hot.eviction.num_refused > 0
    assert figures["a"]["num_refused"] + figures["a"]["num_stored"] == 20
    totals_add_up(hot)
