"""Hot restores taken per run and per group of layers grow like the live cache.

A chain captured two blocks at a time (runs of two blocks) is restored from the
hot tier whole and at a point inside a run (the run's first block only), on a
model of plain K/V layers (llama) and one of window layers beside full ones
(gemma3_text). Every layer's builder takes its blocks together
(``Builder.add_resident``: one entry per run segment for K/V, one per stretch
of consecutive window tokens), and the restored cache, prefilled and decoded
past its length, gives the live run's logits bit for bit. The control: one
token of the run restored in part, changed, gives other logits.
"""

from __future__ import annotations

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.codecs.kv import KVBuilder
from prefixcache.codecs.rotating import RotatingBuilder

BLOCK = 8
CAPTURE = 2 * BLOCK  # tokens per capture: each capture cuts a run of two blocks
STORED = 12 * BLOCK


def spy_taken(monkeypatch) -> list[bool]:
    """What every K/V and window builder's ``add_resident`` answered."""
    answers: list[bool] = []
    for cls in (KVBuilder, RotatingBuilder):
        took = cls.add_resident

        def spy(self, indices, blocks, prefix, took=took):
            answers.append(took(self, indices, blocks, prefix))
            return answers[-1]

        monkeypatch.setattr(cls, "add_resident", spy)
    return answers


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("restored", [STORED, 5 * BLOCK], ids=["whole", "inside-a-run"])
def test_a_chain_restored_by_runs_and_layer_groups_grows_with_the_live_logits(
    arch, restored, monkeypatch
):
    model = tiny_model(arch)
    shared = prompt(11, STORED)
    asked = shared[:restored] + prompt(12, 21)
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_run_tokens=CAPTURE)
    with PrefixCache(model, config, model_id="t") as pc:
        stored = make_prompt_cache(model)
        for stop in range(CAPTURE, STORED + 1, CAPTURE):  # 8-token chunks, as the live run
            prefill(model, shared[stop - CAPTURE : stop], stored, step=BLOCK)
            pc.capture(shared[:stop], stored)
        pc.store(shared, stored)
        assert pc.hot.runs.stats()["num_runs"] == STORED // CAPTURE
        answers = spy_taken(monkeypatch)
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == restored
    assert answers and all(answers), answers  # no layer fell back to one block at a time

    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 6, step=BLOCK)
    got = grow(model, cache, asked[num:], 6, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 7

    # the control: a token of the last run restored (in part, inside a run) changed
    c = bad[-1]
    at = num - BLOCK  # the last restored block's first token
    c.keys[..., at : at + 1, :] = c.keys[..., at : at + 1, :] * 0.5
    wrong = grow(model, bad, asked[num:], 6, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0
