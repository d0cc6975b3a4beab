"""A writer batch larger than ``ssd_max_bytes`` keeps its newest blocks, as LRU would:
the payload files of the chain whose latest block came last are reserved first, each
chain's root first, so what the budget refuses is the older chains' and never a block
whose parent was refused. Checked with a file per block and with run files, the
refusals counted; the control: one chain over the budget keeps its first blocks."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from ssd_child import ROOT, check_block, make_block

from prefixcache import CacheConfig
from prefixcache.blocks import Block
from prefixcache.tiers.ssd.tier import SsdTier

FILE = 3712  # file bytes of one ssd_child block in a file of its own (data 64-byte aligned)


def one_batch(tmp_path, blocks: list[Block], max_bytes: int, run_tokens: int) -> SsdTier:
    """A tier whose writer takes ``blocks`` as one batch."""
    hold = threading.Event()
    config = CacheConfig(
        ssd_dir=str(tmp_path / "ssd"),
        ssd_max_bytes=max_bytes,
        ssd_min_free_bytes=0,
        ssd_run_tokens=run_tokens,
    )
    tier = SsdTier(config, writer_hold=hold)
    assert all(tier.put(b) for b in blocks)
    hold.set()
    tier.flush()
    return tier


def kept(tier: SsdTier, blocks: list[Block]) -> list[bool]:
    return [tier.index.get(b.key) is not None for b in blocks]


def test_a_batch_of_one_block_chains_over_the_budget_keeps_the_newest(tmp_path):
    roots = [dataclasses.replace(make_block(50 + i, 0), parent=ROOT) for i in range(4)]
    with one_batch(tmp_path, roots, 2 * FILE, 0) as tier:
        assert kept(tier, roots) == [False, False, True, True]
        assert tier.stats()["num_no_room"] == 2 and tier.stats()["num_writes"] == 2
        for b in roots[2:]:
            check_block(tier.load(b.key))


@pytest.mark.parametrize("run_tokens", [0, 256])
def test_a_batch_of_chains_over_the_budget_keeps_the_newest_chain_whole(tmp_path, run_tokens):
    old = [make_block(60, i) for i in range(2)]
    new = [make_block(61, i) for i in range(2)]
    mixed = [old[0], new[0], old[1], new[1]]  # interleaved: new's last block comes last
    with one_batch(tmp_path, mixed, 2 * FILE, run_tokens) as tier:
        assert kept(tier, old) == [False, False] and kept(tier, new) == [True, True]
        assert tier.stats()["num_no_room"] == 2


def test_one_chain_over_the_budget_keeps_its_first_blocks(tmp_path):
    chain = [make_block(70, i) for i in range(4)]  # the control: its root first
    with one_batch(tmp_path, chain, 2 * FILE, 0) as tier:
        assert kept(tier, chain) == [True, True, False, False]
        assert tier.stats()["num_no_room"] == 2
