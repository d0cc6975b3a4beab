"""A run file's tensors no layer reads are not read: a window layer's K/V behind it.

gemma3_text (window 16) prefilled in one chunk keeps every block's window K/V
(the rotating cache holds the whole chunk), joined in its run files after the
full layers' (the writer puts what restores mostly skip last). A fetch of the
whole chain uses only the last blocks' window K/V: the earlier run files are
read up to their last used tensor and verified against its lead digest, so a
byte flipped in their window tensors costs nothing, and the restore is exact
and grows. Controls: the same byte is caught (the file quarantined, its blocks
misses) by a fetch that ends inside that run file and so uses its window K/V;
a byte flipped in a tensor the fetch uses fails the file's blocks.
"""

from __future__ import annotations

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_ssd_digests import flip_in, spans_of
from test_ssd_run_files import payload, runs_of, ssd_config

from prefixcache import PrefixCache

BLOCK = 8
RUN = 4 * BLOCK
TOKENS = 12 * BLOCK  # three run files


def stored(tmp_path):
    """A PrefixCache holding the chain in three run files, and the chain."""
    model = tiny_model("gemma3_text")
    tokens = prompt(21, TOKENS)
    cfg = ssd_config(tmp_path, block_size=BLOCK, ssd_run_tokens=RUN)
    pc = PrefixCache(model, cfg, model_id="t")
    assert pc.fetch(tokens)[1] == 0  # its quiet window: one writer batch
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=TOKENS)
    pc.store(tokens, cache)
    pc.flush()
    return pc, model, tokens


def flip(path: str, key: bytes, which: str) -> str:
    """Flip a byte in the middle of the file's last tensor (``which="last"``: a
    window layer's values) or its first (a full layer's keys); the tensor's name."""
    _, spans = spans_of(path, key)
    name = spans[-1][0] if which == "last" else spans[0][0]
    flip_in(path, key, name)
    return name


def corrupt(pc: PrefixCache) -> int:
    return pc.tiers.named("ssd").stats()["num_corrupt"]


def test_window_tensors_behind_the_window_are_not_read_and_the_restore_is_exact(tmp_path):
    pc, model, tokens = stored(tmp_path)
    with pc:
        runs = runs_of(pc, BLOCK)
        assert len({r.file_key for r in runs}) == 3
        first = runs[0].file_key
        name = flip(payload(pc, first), first, "last")
        assert name == "2.values"  # a window layer's (0 and 2), after the full layers'
        asked = tokens + prompt(22, 5)
        restored, num = pc.fetch(asked)
        assert num == TOKENS and corrupt(pc) == 0  # the flipped byte was not read
        got = prefill(model, asked[num:], restored, step=BLOCK)
        live = make_prompt_cache(model)
        prefill(model, asked[:num], live, step=TOKENS)
        assert max_diff(got, prefill(model, asked[num:], live, step=BLOCK)) == 0.0
        grown = prefill(model, prompt(23, 11), restored, step=4)  # past the restored length
        assert max_diff(grown, prefill(model, prompt(23, 11), live, step=4)) == 0.0
        # control: a fetch ending inside the first run file uses its window K/V
        assert pc.fetch(tokens[: RUN + 1])[1] == 0
        assert corrupt(pc) == 4


@pytest.mark.parametrize("which", ["first"])
def test_a_flipped_byte_in_a_used_tensor_fails_the_run_files_blocks(tmp_path, which):
    pc, _, tokens = stored(tmp_path)
    with pc:
        first = runs_of(pc, BLOCK)[0].file_key
        flip(payload(pc, first), first, which)
        assert pc.fetch([*tokens, 1])[1] == 0
        assert corrupt(pc) == 4
