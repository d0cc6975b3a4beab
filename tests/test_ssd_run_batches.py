"""A run file's blocks reach the restore as one unit, and the restored chain grows exactly.

The SSD stream hands the blocks of one run file over together
(``SsdReader.load_run``): the restore takes them in one call and checks the
first alone (the others lie in the same run region). Restored this way, from
run files only or starting inside a run (its first blocks hot), the chain
prefills and decodes past its restored length with the live run's logits bit
for bit; each block is still counted as a hit. The control: one block inside a
unit (not its first) changed gives other logits. The readers open a run file
relative to the payloads' root held open, and refuse one that became a symlink.
"""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import grow
from test_ssd_run_files import BLOCK, runs_of, ssd_config, store

from prefixcache import PrefixCache
from prefixcache.cache import restore
from prefixcache.tiers.ssd.files import payload_path


def spy_units(monkeypatch) -> list[tuple[int, int]]:
    """(first index, number of blocks) of each unit the restore took from a tier."""
    units: list[tuple[int, int]] = []
    payloads = restore.ChainLoad.payloads

    def spy(self, index, limit):
        got, resident = payloads(self, index, limit)
        units.append((index, len(got)))
        return got, resident

    monkeypatch.setattr(restore.ChainLoad, "payloads", spy)
    return units


@pytest.mark.parametrize("where", ["ssd", "hot+ssd"])
def test_a_run_files_blocks_are_restored_as_one_unit_and_grow_exactly(tmp_path, monkeypatch, where):
    model = tiny_model("llama")
    tokens = prompt(11, 10 * BLOCK + 5)
    asked = tokens[: 10 * BLOCK] + prompt(12, 40)
    with PrefixCache(model, ssd_config(tmp_path), model_id="t") as pc:
        store(pc, model, tokens)
        assert [r.position for r in runs_of(pc)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    hot = 64 << 20 if where == "hot+ssd" else 1
    again = ssd_config(
        tmp_path, hot_max_bytes=hot, promote=where == "hot+ssd", background_quiet_ms=0
    )
    with PrefixCache(model, again, model_id="t") as pc:
        if where == "hot+ssd":  # blocks 0 and 1 promoted: the restore starts inside a run
            pc.fetch(tokens[: 2 * BLOCK + 1])
            assert pc.prefetcher.join(timeout=60)
            assert pc.stats()["hot"]["num_blocks"] == 2
        hits = pc.stats()["ssd_block_hits"]
        units = spy_units(monkeypatch)
        cache, num = pc.fetch(asked)
        assert num == 10 * BLOCK
        if where == "ssd":
            assert units == [(0, 4), (4, 4), (8, 2)]
            assert pc.stats()["ssd_block_hits"] - hits == 10  # a hit per block, not per unit
        else:  # hot blocks 0, 1 one by one, the first run file's last two as one unit
            assert units == [(0, 1), (1, 1), (2, 2), (4, 4), (8, 2)]
            assert pc.stats()["ssd_block_hits"] - hits == 8
        bad, _ = pc.fetch(asked)
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 4, step=BLOCK)
    got = grow(model, cache, asked[num:], 4, step=BLOCK)
    assert cache[0].offset == len(asked) + 4
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5

    # the control: block 6 (the third of the second unit) of one layer changed
    layer = bad[1]
    layer.keys[..., 6 * BLOCK : 7 * BLOCK, :] = layer.keys[..., 6 * BLOCK : 7 * BLOCK, :] + 1
    wrong = grow(model, bad, asked[num:], 4, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


@pytest.mark.parametrize("linked", [True, False], ids=["symlink", "control_real_file"])
def test_a_run_file_replaced_by_a_symlink_is_refused_by_the_readers(tmp_path, linked):
    """The readers open run files relative to the payloads' root held open: a run
    file that became a symlink (to a copy with the very same bytes, so following it
    would pass every check) fails its blocks. The control: the same copy moved back
    as a real file restores the chain."""
    model = tiny_model("llama")
    tokens = prompt(13, 8 * BLOCK + 3)
    with PrefixCache(model, ssd_config(tmp_path, background_quiet_ms=0), model_id="t") as pc:
        store(pc, model, tokens)
        first = runs_of(pc)[0]
        path = payload_path(os.path.join(pc.ssd.path, "blocks"), first.file_key)
        outside = str(tmp_path / "outside.safetensors")
        shutil.copyfile(path, outside)
        os.remove(path)
        if linked:
            os.symlink(outside, path)
        else:
            shutil.move(outside, path)
        _, num = pc.fetch(tokens)
        assert num == (0 if linked else 8 * BLOCK + 2)
        assert (pc.ssd.stats()["num_corrupt"] > 0) == linked
