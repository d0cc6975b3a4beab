"""A chain restored from the SSD tier through either read path (small files in
runs, large files straight into place) grows like the live run: a prefill past
the restored buffers' end, then greedy decode steps, with the live logits bit
for bit. The control: one restored block changed gives other logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import BLOCK, WIDE, config, grow

from prefixcache import PrefixCache
from prefixcache.tiers.ssd import readers
from prefixcache.tiers.ssd import runs as ssd_runs


@pytest.mark.parametrize("path", ["runs", "large"])
def test_a_chain_from_either_read_path_grows_with_the_live_logits(tmp_path, monkeypatch, path):
    if path == "large":  # every payload read straight into place, in runs of large files
        monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    taken = {"runs": 0, "large": 0}

    def counted(kind, read):
        def counting(jobs, *args, **kwargs):
            taken[kind] += len(jobs)
            yield from read(jobs, *args, **kwargs)

        return counting

    monkeypatch.setattr(readers, "read_run", counted("runs", readers.read_run))
    monkeypatch.setattr(readers, "read_large_run", counted("large", readers.read_large_run))
    model = tiny_model("llama", **WIDE)
    shared = prompt(51, 6 * BLOCK)
    stored_tokens, asked = shared + prompt(52, 20), shared + prompt(53, 300)
    with PrefixCache(
        model, replace(config("ssd", tmp_path, 0), ssd_run_tokens=0), model_id="t"
    ) as pc:
        cache = make_prompt_cache(model)
        prefill(model, stored_tokens, cache, step=BLOCK)
        pc.store(stored_tokens, cache)
        pc.flush()
        del cache
        assert pc.stats()["hot"]["num_blocks"] == 0  # every block from the SSD tier
        (restored, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == 6 * BLOCK
    assert taken[path] == 2 * 6 and sum(taken.values()) == 2 * 6  # both fetches, one path
    assert restored[0].keys.shape[2] < len(asked)  # the prefill grows the buffers
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 4)
    got = grow(model, restored, asked[num:], 4)
    assert restored[0].offset == len(asked) + 4
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5

    # the control: block 3 of one layer's values changed, the logits differ
    b = bad[2]
    b.values[..., 3 * BLOCK : 4 * BLOCK, :] = b.values[..., 3 * BLOCK : 4 * BLOCK, :] * 0.5
    wrong = grow(model, bad, asked[num:], 4)
    assert max_diff(wrong[0], want[0]) > 0.0
