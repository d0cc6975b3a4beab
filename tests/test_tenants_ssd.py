"""Tenant shares of the SSD tier: floors kept under another tenant's flood, caps that
evict the tenant's own blocks, counts kept in the index (right across processes and
restarts), an index of the previous format read as the default tenant's, bad input."""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import lmdb
import pytest
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import check_block, make_block

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block, decode_meta
from prefixcache.errors import ConfigError
from prefixcache.tiers.ssd import shares
from prefixcache.tiers.ssd.index import SsdIndex
from prefixcache.tiers.ssd.shares import Limits
from prefixcache.tiers.ssd.tier import SsdTier

HERE = Path(__file__).parent
V1_INDEX = HERE / "data" / "ssd_v1"  # written by the SSD format of version 1 (no tenants)
FILE = 3712  # file bytes of one ssd_child block (digests and lead digests in its header)


@pytest.fixture
def open_tier(tmp_path):
    """Open SSD tiers (default dir: tmp_path/ssd); every one is closed at teardown."""
    tiers: list[SsdTier] = []

    def opener(path=None, **settings) -> SsdTier:
        base = {"ssd_max_bytes": 1 << 30, "ssd_min_free_bytes": 0, "queue_full": "inline"}
        config = CacheConfig(
            ssd_run_tokens=0, ssd_dir=str(path or tmp_path / "ssd"), **(base | settings)
        )
        tiers.append(SsdTier(config))
        return tiers[-1]

    yield opener
    for tier in tiers:
        tier.close()


def owned(seed: int, index: int, tenant: str, **options) -> Block:
    return dataclasses.replace(make_block(seed, index, **options), tenant=tenant)


def put_chain(tier: SsdTier, tenant: str, seed: int, length: int) -> list[Block]:
    blocks = [owned(seed, i, tenant) for i in range(length)]
    for block in blocks:
        tier.put(block)
    tier.flush()
    return blocks


def held(tier: SsdTier, blocks: list[Block]) -> int:
    return sum(tier.index.get(b.key) is not None for b in blocks)


def add_up(tier: SsdTier) -> dict[str, dict[str, int]]:
    """Every tenant: stored = held + evicted + removed; held adds up to the tier's."""
    figures = tier.tenant_stats()
    for name, f in figures.items():
        assert f["num_stored"] == f["num_blocks"] + f["num_evicted"] + f["num_removed"], name
        assert f["num_cap_evictions"] <= f["num_evicted"], name
    totals = tier.index.totals()
    assert sum(f["nbytes"] for f in figures.values()) == totals["nbytes"]
    assert sum(f["num_blocks"] for f in figures.values()) == totals["num_blocks"]
    return figures


def test_floors_keep_b_and_c_while_a_floods_and_without_them_they_go(open_tier, tmp_path):
    def flood(path: Path, **shares) -> tuple[int, int, SsdTier]:
        tier = open_tier(path, ssd_max_bytes=20 * FILE, **shares)
        b = put_chain(tier, "b", 1, 4)
        c = put_chain(tier, "c", 2, 4)
        for j in range(100):  # a: 100 one-off prompts of 2 blocks, 10x the budget
            put_chain(tier, "a", 1000 + j, 2)
        return held(tier, b), held(tier, c), tier

    b, c, tier = flood(tmp_path / "floors", ssd_tenant_floors=f"b={4 * FILE},c={4 * FILE}")
    assert (b, c) == (4, 4)
    figures = add_up(tier)
    assert figures["a"]["num_evicted"] >= 180 and figures["b"]["num_evicted"] == 0
    assert tier.index.totals()["nbytes"] <= 20 * FILE
    b, c, bare = flood(tmp_path / "bare")  # negative control: no floors
    assert (b, c) == (0, 0)
    assert add_up(bare)["b"]["num_evicted"] == 4


def test_the_tenant_most_over_its_floor_gives_first(open_tier):
    tier = open_tier(ssd_max_bytes=10 * FILE, ssd_tenant_floors=f"b={2 * FILE}")
    b = put_chain(tier, "b", 3, 5)  # 3 blocks over its floor
    a = put_chain(tier, "a", 4, 4)  # 4 over (no floor): a gives first
    put_chain(tier, "a", 5, 2)  # 11 blocks: one must go
    assert held(tier, b) == 5 and held(tier, a) == 3
    put_chain(tier, "c", 6, 3)  # 3 go: a (5 over b's 3), a (4 over 3), a (3 and 3: by name)
    figures = add_up(tier)
    assert {name: f["num_blocks"] for name, f in figures.items()} == {"a": 2, "b": 5, "c": 3}
    put_chain(tier, "c", 7, 2)  # then b (3 over a's 2), then a or b (2 each)
    figures = add_up(tier)
    assert figures["b"]["num_evicted"] >= 1 and figures["b"]["num_blocks"] >= 2


def test_a_cap_evicts_a_s_own_blocks_and_a_block_over_it_is_refused(open_tier, tmp_path):
    tier = open_tier(ssd_tenant_caps=f"a={5 * FILE}")
    b = put_chain(tier, "b", 7, 3)
    for j in range(12):
        put_chain(tier, "a", 2000 + j, 1)
    figures = add_up(tier)
    assert figures["a"]["num_blocks"] == 5 and figures["a"]["nbytes"] <= 5 * FILE
    assert figures["a"]["num_cap_evictions"] == 7 == figures["a"]["num_evicted"]
    assert held(tier, b) == 3 and figures["b"]["num_evicted"] == 0
    tier.put(owned(2100, 0, "a", scale=8))  # 8x a block: over a's cap alone
    tier.flush()
    figures = add_up(tier)
    assert figures["a"]["num_refused"] == 1 and figures["a"]["num_blocks"] == 5
    assert tier.stats()["num_no_room"] == 1 and tier.stats()["num_dropped_writes"] == 1
    bare = open_tier(tmp_path / "bare")  # negative control: no cap
    for j in range(12):
        put_chain(bare, "a", 2000 + j, 1)
    assert bare.tenant_stats()["a"]["num_blocks"] == 12


def test_counts_add_up_across_processes_and_a_restart(open_tier, tmp_path):
    path = tmp_path / "ssd"
    shares = {"ssd_max_bytes": 12 * FILE, "ssd_tenant_floors": f"b={3 * FILE}"}
    tier = open_tier(path, **shares)
    b = put_chain(tier, "b", 8, 3)
    for j in range(8):
        put_chain(tier, "a", 3000 + j, 2)
    assert tier.remove([b[-1].key]) == 1
    child = subprocess.run(  # another process writes 5 blocks of the default tenant
        [sys.executable, str(HERE / "ssd_child.py"), "write", str(path), "9", "5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip().endswith("done")
    before = add_up(tier)  # read from the index: the child's writes are in it
    assert before[""]["num_stored"] == 5
    assert before["b"]["num_removed"] == 1 and before["b"]["num_blocks"] == 2
    tier.close()
    again = open_tier(path, **shares)
    after = add_up(again)
    assert after == before


def test_two_processes_writing_at_once_keep_one_right_set_of_figures(tmp_path):
    path = str(tmp_path / "ssd")
    floors = f"b={6 * FILE}"
    shares = [str(12 * FILE), floors]
    child = [sys.executable, str(HERE / "ssd_child.py"), "write", path]
    procs = [
        subprocess.Popen(
            [*child, str(seed), "60", "--wait", "--shares", tenant, *shares],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed, tenant in ((20, "a"), (21, "b"))
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:  # both write, and evict, at once
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip().endswith("done")
    config = {"ssd_max_bytes": 12 * FILE, "ssd_min_free_bytes": 0, "ssd_tenant_floors": floors}
    with SsdTier(CacheConfig(ssd_run_tokens=0, ssd_dir=path, **config)) as tier:
        figures = add_up(tier)
        assert figures["a"]["num_stored"] + figures["a"]["num_refused"] == 60
        assert figures["b"]["num_stored"] + figures["b"]["num_refused"] == 60
        assert figures["b"]["num_blocks"] >= 6  # its floor, whichever process evicted
        assert tier.index.totals()["nbytes"] <= 12 * FILE
        for meta in tier.iter_meta():
            check_block(tier.load(meta.key))


def test_blocks_dropped_for_a_full_queue_are_refused_for_their_tenant(tmp_path):
    hold = threading.Event()  # the writer waits: the queue stays full
    config = CacheConfig(
        ssd_run_tokens=0,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        queue_full="drop",
        write_queue_bytes=2 * 3072,  # two blocks of ssd_child
        ssd_tenant_caps="a=1M",
    )
    with SsdTier(config, writer_hold=hold) as tier:
        assert all(tier.put(b) for b in [owned(40, 0, "b"), owned(40, 1, "b")])
        assert not any(tier.put(owned(41, i, "a")) for i in range(3))
        assert tier.tenant_stats()["a"]["num_refused"] == 3  # counted, not recorded yet
        hold.set()
        tier.flush()
        figures = add_up(tier)
        recorded = tier.index.tenants()  # in the index now: every process sees them
        assert figures["a"]["num_refused"] == recorded["a"]["num_refused"] == 3
        assert figures["b"]["num_refused"] == 0 and figures["b"]["num_stored"] == 2
        assert tier.stats()["num_dropped_writes"] == 3


def brute_over_floor(txn, db, limits: Limits, pending, *, with_pending: bool = True) -> list[str]:
    """Every tenant read and sorted: the order ``Limits.over_floor`` must give."""
    held = shares.every(txn, db)
    over = []
    for name in {*held, *pending, *limits.floors}:
        nbytes = held[name]["nbytes"] if name in held else 0
        above = nbytes + (pending.get(name, 0) if with_pending else 0)
        above -= limits.floors.get(name, 0)
        if above > 0:
            over.append((-above, name))
    return [name for _, name in sorted(over)]


def orders(db, limits: Limits, pending, txn) -> tuple[list[str], list[str], list[str]]:
    """``over_floor``'s order, the brute force's, and the brute force's without pending."""
    got = list(limits.over_floor(txn, db, pending))
    want = brute_over_floor(txn, db, limits, pending)
    return got, want, brute_over_floor(txn, db, limits, pending, with_pending=False)


def test_the_tenant_most_over_its_floor_comes_first_as_when_every_one_was_read(open_tier):
    tier = open_tier()
    db = tier.index.entries.db["meta"]
    rng = random.Random(5)
    names = [f"t{i}" for i in range(40)] + ["", "\u00e9t\u00e9"]
    sizes = [0, 1, 4096, 4096, 8192, 10**6]  # repeated sizes: ties broken by name
    differs = 0
    for _ in range(30):
        limits = Limits(
            {n: rng.choice(sizes) for n in rng.sample(names, 8)},
            {},
        )
        pending = {n: rng.choice(sizes) for n in rng.sample(names, 3)}

        def change(txn):
            for name in rng.sample(names, 10):  # grow, shrink, to 0 and back
                delta = rng.choice([-(10**6), -4096, 0, 4096, 8192, 10**6])
                shares.add(txn, db, name, {"nbytes": delta})

        tier.index.transact(change, write=True)

        got, want, without = tier.index.transact(partial(orders, db, limits, pending))
        assert got == want
        differs += without != want  # negative control: the comparison sees a change
    assert differs > 0

    def forget_sizes(txn):  # an index written before the sizes were kept
        keys = [bytes(k) for k, _ in txn.cursor(db=db) if bytes(k).startswith(b"tenant_size")]
        for key in keys:
            txn.delete(key, db=db)
        shares.keep_sizes(txn, db)
        return orders(db, Limits({}, {}), {}, txn)[:2]

    got, want = tier.index.transact(forget_sizes, write=True)
    assert got == want and len(got) > 10


def test_gc_removing_dangling_entries_counts_them_removed_for_their_tenant(open_tier):
    from prefixcache.tiers.ssd.admin.maintenance import reconcile

    tier = open_tier(ssd_tenant_floors=f"b={2 * FILE}")
    b = put_chain(tier, "b", 11, 3)
    put_chain(tier, "a", 12, 2)
    Path(tier.payload_file(b[-1].key)).unlink()  # its entry now dangles
    assert reconcile(tier.index) == (0, 1)
    figures = add_up(tier)
    assert figures["b"]["num_removed"] == 1 and figures["b"]["num_blocks"] == 2
    assert figures["a"]["num_removed"] == 0 and figures["a"]["num_blocks"] == 2


def test_an_index_of_the_old_format_opens_and_nothing_stored_is_lost(open_tier, tmp_path):
    path = tmp_path / "ssd"
    shutil.copytree(V1_INDEX, path)
    env = lmdb.open(str(path / "index"), max_dbs=16, readonly=True)
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        assert txn.get(b"version", db=env.open_db(b"meta", create=False)) == b"1"
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        raws = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    env.close()
    assert len(raws) == 6 and all(v[0] == 1 for _, v in raws)  # format 1 entries
    assert {decode_meta(k, v).tenant for k, v in raws} == {""}
    index = SsdIndex(str(path / "index"), str(path / "blocks"), readonly=True)
    assert len(list(index.rows())) == 6 and index.tenants() == {}  # read as it is
    assert index.format_version == 1
    index.close()
    tier = open_tier(path, ssd_tenant_floors=f"b={2 * FILE}")  # upgraded on open
    figures = add_up(tier)
    assert figures[""]["num_blocks"] == 6 == figures[""]["num_stored"]
    for meta in tier.iter_meta():
        check_block(tier.load(meta.key))
    put_chain(tier, "b", 10, 2)
    tier.close()
    again = open_tier(path)
    assert add_up(again)[""]["num_stored"] == 6 and again.tenant_stats()["b"]["num_blocks"] == 2
    assert again.index.transact(lambda t: t.get(b"version", db=again.index._db["meta"])) == b"3"
    assert again.index.format_version == 3


# -- through the library ----------------------------------------------------------------


def stored(pc: PrefixCache, model, tokens: list[int], **options) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    pc.store(tokens, cache, **options)


def test_ssd_floors_keep_b_s_system_prompt_when_a_floods_hot_and_ssd(tmp_path):
    model = tiny_model("llama")
    system = prompt(7, 32)

    def b_after_flood(name: str, **shares) -> tuple[int, dict]:
        config = CacheConfig(
            ssd_run_tokens=0,
            block_size=16,
            hot_max_bytes=24 << 10,
            ssd_dir=str(tmp_path / name),
            ssd_max_bytes=96 << 10,
            ssd_min_free_bytes=0,
            **shares,
        )
        with PrefixCache(model, config, model_id="t") as pc:
            stored(pc, model, system, tenant="b")
            for i in range(30):  # a: one-off prompts of 48 tokens, several times the SSD
                stored(pc, model, prompt(100 + i, 48), tenant="a")
                pc.flush()  # written store by store (one batch of all: refused past the cap)
            return pc.match([*system, 1, 2, 3]), pc.stats()

    hits, stats = b_after_flood("floors", ssd_tenant_floors="b=32K")
    assert hits == 32
    ssd = stats["tenants"]["b"]["ssd"]
    assert ssd["num_blocks"] == 2 and ssd["floor_bytes"] == 32 << 10
    assert stats["tenants"]["a"]["ssd"]["num_evicted"] > 0
    assert sum(t["ssd"]["nbytes"] for t in stats["tenants"].values()) == stats["ssd"]["nbytes"]
    hits, stats = b_after_flood("bare")  # negative control: no floors, nothing charged
    assert hits == 0 and "tenants" not in stats


def test_stats_cli_and_prometheus_show_the_ssd_figures_per_tenant(tmp_path):
    from test_cli import cli, cli_all

    from prefixcache.prometheus import prometheus_text

    model = tiny_model("llama")
    ssd = str(tmp_path / "ssd")
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=16,
        hot_max_bytes=16 << 10,
        ssd_dir=ssd,
        ssd_max_bytes=64 << 10,
        ssd_min_free_bytes=0,
        ssd_tenant_caps="a=24K",
    )
    with PrefixCache(model, config, model_id="t") as pc:
        stored(pc, model, prompt(11, 32), tenant="b")
        for i in range(6):  # each store's spills written before the next: batches under the cap
            stored(pc, model, prompt(20 + i, 32), tenant="a")
            pc.flush()
        live = pc.stats()
    text = prometheus_text(live)
    a = live["tenants"]["a"]["ssd"]
    assert a["num_cap_evictions"] > 0 and a["nbytes"] <= 24 << 10
    line = (
        f'prefixcache_tenant_cap_evictions_total{{tenant="a",tier="ssd"}} {a["num_cap_evictions"]}'
    )
    assert line in text.splitlines()
    doc, only_a, shown = cli_all(
        ("stats", "--ssd-dir", ssd, "--json"),
        ("stats", "--ssd-dir", ssd, "--tenant", "a", "--json"),
        ("stats", "--ssd-dir", ssd),
    )
    for name in ("a", "b"):
        figures = {k: v for k, v in live["tenants"][name]["ssd"].items() if "_bytes" not in k}
        assert doc["ssd_tenants"][name] == figures
    assert only_a["ssd_tenants"].keys() == {"a"}
    assert "ssd tier per tenant (blocks):" in shown and "'b'" in shown
    err = cli("stats", "--ssd-dir", ssd, "--tenant", "nobody", code=2)
    assert err.strip().splitlines() == [
        "prefixcache stats: --tenant 'nobody': no counters of that tenant ('a', 'b')"
    ]


def test_a_salt_too_long_for_the_index_is_charged_under_its_digest(tmp_path):
    model = tiny_model("llama")
    salt = "\U0001f600" * 200  # 800 UTF-8 bytes: over what the index's keys take (511)
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=16,
        hot_max_bytes=16 << 10,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        ssd_tenant_floors="b=16K",
    )
    with PrefixCache(model, config, model_id="t") as pc:
        for i in range(3):
            stored(pc, model, prompt(30 + i, 32), extra={"cache_salt": salt})
        pc.flush()
        stats = pc.stats()
    assert stats["ssd"]["enabled"] == 1 and stats["ssd"]["num_failures"] == 0
    (name,) = [n for n in stats["tenants"] if n.startswith("#")]
    assert len(name) == 33 and stats["tenants"][name]["ssd"]["num_stored"] > 0
    with pytest.raises(ConfigError, match="is over 256 bytes"):
        CacheConfig(ssd_run_tokens=0, ssd_tenant_floors=f"{salt}=1K")


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"ssd_tenant_floors": "b"}, "'b'"),
        ({"ssd_tenant_caps": "a=x"}, "'a=x'"),
        ({"ssd_tenant_floors": "b=2M"}, "tenant 'b' floor 2097152 is above ssd_max_bytes"),
        ({"ssd_tenant_floors": "b=600K,c=600K"}, "sums to 1228800"),
        ({"ssd_tenant_floors": "b=64K", "ssd_tenant_caps": "b=32K"}, "tenant 'b' cap 32768"),
    ],
)
def test_bad_ssd_shares_are_refused_naming_the_value(changes, named):
    with pytest.raises(ConfigError, match=named) as err:
        CacheConfig(ssd_run_tokens=0, ssd_max_bytes=1 << 20, **changes)
    assert err.value.field in changes
    assert "\n" not in str(err.value)


def test_bench_tenants_ssd_floors_match_running_alone_and_lose_nothing():
    sys.path.insert(0, str(HERE.parent / "tools"))
    import bench_tenants

    argv = ["--tier", "ssd", "--hot", "32K", "--ssd", "128K", "--rounds", "2", "--flood", "4"]
    args = bench_tenants.setup_arg_parser().parse_args([*argv, "--system-tokens", "32"])
    model = tiny_model("llama")
    trace = bench_tenants.make_trace(args, 8192)
    base = {"block_size": 16, "hot_max_bytes": args.hot, "ssd_max_bytes": args.ssd}
    base |= {"ssd_min_free_bytes": 0, "ssd_admit_after": 1, "queue_full": "inline"}
    alone = [r for r in trace if r.tenant != "a"]

    def run(requests, name, **shares):
        config = CacheConfig(ssd_run_tokens=0, **base, **shares)
        return bench_tenants.run(model, requests, config, name, "ssd")

    solo = run(alone, "alone")
    bare = run(trace, "no shares")
    fair = run(trace, "floors", ssd_tenant_floors="b=32K,c=32K")
    assert fair.shares["b"].percent == solo.shares["b"].percent > 0
    assert fair.shares["c"].percent == solo.shares["c"].percent
    assert bare.shares["b"].percent < solo.shares["b"].percent  # the control: A's flood
    assert fair.counts["lost"] == 0 == fair.counts["unmatched"]
    assert fair.counts["num_evicted"] > 0
