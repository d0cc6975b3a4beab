"""Tenant shares of the SSD tier on run files (the default ``ssd_run_tokens``).

A chain written in one batch is one run file, charged once to its tenant and freed
with its last block: the tenant most over its floor still gives first (its least
recently used run goes whole, its file unlinked), a cap evicts the tenant's own
runs, a run refused under the cap or the budget counts each of its blocks refused
for its tenant, and ``gc`` removing a run file's dangling blocks counts each one
removed and uncharges the file once. Byte figures are the real files' sizes. The
controls: without floors the oldest run goes whoever owns it; without a cap
nothing of the tenant's is evicted.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
from ssd_child import check_block, make_block
from test_tenants_ssd import add_up, held

from prefixcache import CacheConfig
from prefixcache.blocks import Block
from prefixcache.tiers.ssd.admin.maintenance import reconcile
from prefixcache.tiers.ssd.tier import SsdTier

RUN = 256  # the default: a chain of up to 16 ssd_child blocks in one file
SLACK = 512  # a run's reservation bounds its header from its first block's: a few bytes more


class Tier:
    """An SSD tier whose writer takes each chain put through ``chain`` as one batch."""

    def __init__(self, path: Path, **settings) -> None:
        base = {"ssd_max_bytes": 1 << 30, "ssd_min_free_bytes": 0, "ssd_run_tokens": RUN}
        self.hold = threading.Event()
        config = CacheConfig(ssd_dir=str(path), **(base | settings))
        self.tier = SsdTier(config, writer_hold=self.hold)

    def chain(self, tenant: str, seed: int, length: int, scale: int = 1) -> list[Block]:
        blocks = [
            dataclasses.replace(make_block(seed, i, scale=scale), tenant=tenant)
            for i in range(length)
        ]
        self.hold.clear()
        for block in blocks:
            assert self.tier.put(block)
        self.hold.set()  # the writer takes them all at once
        self.tier.flush()
        return blocks

    def file(self, blocks: list[Block]) -> str:
        """The one payload file ``blocks`` lie in (a run file)."""
        (path,) = {self.tier.payload_file(b.key) for b in blocks}
        return path


@pytest.fixture
def open_tier(tmp_path):
    tiers: list[Tier] = []

    def opener(name: str, **settings) -> Tier:
        tiers.append(Tier(tmp_path / name, **settings))
        return tiers[-1]

    yield opener
    for t in tiers:
        t.tier.close()


def sizes(tmp_path) -> tuple[int, int]:
    """File bytes of a run of 4 and of a run of 2 ssd_child blocks, as written."""
    t = Tier(tmp_path / "sizes")
    four, two = t.chain("x", 90, 4), t.chain("x", 91, 2)
    out = os.path.getsize(t.file(four)), os.path.getsize(t.file(two))
    t.tier.close()
    return out


def test_the_tenant_most_over_its_floor_gives_its_oldest_run_whole(open_tier, tmp_path):
    four, two = sizes(tmp_path)

    def flood(name: str, **shares) -> tuple[Tier, list[Block], list[Block], list[Block]]:
        t = open_tier(name, ssd_max_bytes=2 * four + two + SLACK, **shares)
        b = t.chain("b", 1, 4)  # one run file
        a1, a2 = t.chain("a", 2, 4), t.chain("a", 3, 2)  # full: a over by a whole run more
        assert len({t.file(b), t.file(a1), t.file(a2)}) == 3
        t.chain("c", 4, 2)  # room for a run of 2: a's oldest run goes, all 4 blocks
        return t, b, a1, a2

    t, b, a1, a2 = flood("floors", ssd_tenant_floors=f"b={four // 2}")
    files = {name: t.file(blocks) for name, blocks in (("b", b), ("a2", a2))}
    assert (held(t.tier, b), held(t.tier, a1), held(t.tier, a2)) == (4, 0, 4 - 2)
    figures = add_up(t.tier)
    assert figures["a"]["num_evicted"] == 4 and figures["a"]["nbytes"] == two
    assert figures["b"]["num_evicted"] == 0 and figures["b"]["nbytes"] == four
    assert figures["c"]["num_blocks"] == 2 and figures["c"]["nbytes"] == two
    assert all(os.path.exists(f) for f in files.values())
    blocks = Path(t.tier.path) / "blocks"
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(blocks) for f in fs)
    assert on_disk == t.tier.index.totals()["nbytes"] == four + 2 * two
    for meta in t.tier.iter_meta():
        check_block(t.tier.load(meta.key))
    t, b, a1, _ = flood("bare")  # negative control: no floors, the oldest run (b's) goes
    assert (held(t.tier, b), held(t.tier, a1)) == (0, 4)
    assert add_up(t.tier)["b"]["num_evicted"] == 4


def test_a_cap_evicts_the_tenant_s_own_runs_and_a_run_over_it_is_refused_block_by_block(
    open_tier, tmp_path
):
    _, two = sizes(tmp_path)
    t = open_tier("cap", ssd_tenant_caps=f"a={2 * two + SLACK}")
    b = t.chain("b", 7, 3)
    for j in range(5):
        t.chain("a", 200 + j, 2)
    figures = add_up(t.tier)
    assert figures["a"]["num_blocks"] == 4 and figures["a"]["nbytes"] == 2 * two
    assert figures["a"]["num_cap_evictions"] == 6 == figures["a"]["num_evicted"]
    assert held(t.tier, b) == 3 and figures["b"]["num_evicted"] == 0
    t.chain("a", 300, 5)  # one run file of 5 blocks: over a's cap alone
    figures = add_up(t.tier)
    assert figures["a"]["num_refused"] == 5 and figures["a"]["num_blocks"] == 4
    assert t.tier.stats()["num_no_room"] == 5 and t.tier.stats()["num_dropped_writes"] == 5
    bare = open_tier("bare")  # negative control: no cap
    for j in range(5):
        bare.chain("a", 200 + j, 2)
    assert add_up(bare.tier)["a"]["num_evicted"] == 0


def test_a_run_over_the_budget_counts_each_of_its_blocks_refused(open_tier, tmp_path):
    four, _ = sizes(tmp_path)
    t = open_tier("budget", ssd_max_bytes=four - 1)
    t.chain("a", 8, 4)  # one file of 4 blocks, one byte over the budget
    figures = add_up(t.tier)
    assert figures["a"]["num_refused"] == 4 and figures["a"]["num_blocks"] == 0
    assert t.tier.stats()["num_no_room"] == 4
    t.chain("a", 9, 3)  # control: a run of 3 fits
    assert add_up(t.tier)["a"]["num_blocks"] == 3


def test_gc_removing_a_run_file_s_blocks_counts_each_removed_and_uncharges_it_once(
    open_tier, tmp_path
):
    _, two = sizes(tmp_path)
    t = open_tier("gc", ssd_tenant_floors=f"b={two}")
    b = t.chain("b", 11, 4)
    a = t.chain("a", 12, 2)
    b2 = t.chain("b", 13, 2)
    Path(t.file(b)).unlink()  # its 4 entries now dangle
    assert reconcile(t.tier.index) == (0, 4)
    figures = add_up(t.tier)
    assert figures["b"]["num_removed"] == 4 and figures["b"]["num_blocks"] == 2
    assert figures["b"]["nbytes"] == two == figures["a"]["nbytes"]
    assert figures["a"]["num_removed"] == 0 and held(t.tier, a) == 2 == held(t.tier, b2)
    assert t.tier.index.totals()["nbytes"] == 2 * two
