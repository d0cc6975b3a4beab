"""Run files that grow with their depth in the chain, and short windows kept whole per block.

With ``ssd_run_growth``, a run file holds up to that share of the chain's tokens
before it, where that is more than ``ssd_run_tokens``: the writer's grouping
and its cut at the batch bound follow the same lengths (``run_length.py``), a
chain stored so restores exactly and grows, and a prompt leaving it inside a
long run too. The controls: growth 0 keeps every run ``ssd_run_tokens``.

A window layer whose window one block holds (gemma3_text's 16 tokens at block
16) keeps its K/V whole per block in a run file (an extra) instead of joined
with the run's: a fetch of the whole chain reads the last block's only, each
verified by its own digest, so a byte flipped in an earlier block's window K/V
of the same file is never read, while one flipped in the last block's fails
the file's blocks. The control: at block 8 (window 16: two blocks) the window
K/V stays joined.
"""

from __future__ import annotations

import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import make_block
from test_restore_grows import grow
from test_ssd_digests import flip_in, spans_of
from test_ssd_run_files import payload, runs_of, ssd_config

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import ConfigError
from prefixcache.memory.host import tensors_of
from prefixcache.tiers import run_length
from prefixcache.tiers.ssd import checked, digests, run_layout, runfiles
from prefixcache.tiers.writer import WriteItem

BLOCK = 16


def items(count: int, seed: int = 3) -> list[WriteItem]:
    blocks = [make_block(seed, i) for i in range(count)]  # 16 tokens each
    return [WriteItem(b, tensors_of(b.arrays), b.nbytes) for b in blocks]


def test_a_run_holds_its_tokens_or_its_share_of_those_before_it():
    assert run_length.run_blocks(0, 16, 64) == 4
    assert run_length.run_blocks(16, 16, 64) == 4  # no growth: always 64 tokens
    assert run_length.run_blocks(16, 16, 64, 0.5) == 8  # 256 tokens before: 128
    assert run_length.run_blocks(3, 16, 64, 1.0) == 4  # 48 before: 64 is more
    assert run_length.run_blocks(5, 16, 0, 1.0) == 5
    assert run_length.run_blocks(0, 16, 0) == 1  # at least one block


def test_the_writers_grouping_follows_the_growing_runs():
    batch = items(30)
    lengths = [len(r) for r in runfiles.group(batch, 64, 1.0)]
    assert lengths == [4, 4, 8, 14]  # from 0: 64 tokens; 4: 64; 8: 128; 16: 256 (14 left)
    assert [len(r) for r in runfiles.group(batch, 64)] == [4] * 7 + [2]  # the control


def test_a_batch_cut_at_its_bound_ends_at_the_last_whole_growing_run():
    batch = items(13)
    after, batch = batch[-1], batch[:-1]  # the chain goes on in the queue
    assert len(run_length.whole_runs(batch, after, 64, 1.0)) == 8  # runs of 4, 4, then 8
    assert len(run_length.whole_runs(batch, after, 64)) == 12  # the control: runs of 4


@pytest.mark.parametrize("bad", [-0.5, 17, float("inf"), "1", True])
def test_a_bad_growth_is_refused_naming_the_value(bad):
    with pytest.raises((ValueError, ConfigError), match="ssd_run_growth"):
        CacheConfig(ssd_run_growth=bad)


def test_a_chain_in_growing_run_files_restores_exactly_and_grows(tmp_path):
    model = tiny_model("llama")
    tokens = prompt(3, 20 * BLOCK + 3)
    cfg = ssd_config(tmp_path, ssd_run_tokens=2 * BLOCK, ssd_run_growth=1.0)
    with PrefixCache(model, cfg, model_id="t") as pc:
        assert pc.fetch(tokens)[1] == 0  # its quiet window: one writer batch
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, step=BLOCK)
        pc.store(tokens, cache)
        pc.flush()
        counts = [r.count for r in runs_of(pc)]
        assert counts == [2] * 4 + [4] * 4 + [8] * 8 + [4] * 4  # from 0, 2, 4, 8, 16
        asked = tokens + prompt(4, 9)
        restored, num = pc.fetch(asked)
        inside = tokens[: 11 * BLOCK + 5] + prompt(5, 20)  # in the run of blocks 8-15
        part, at = pc.fetch(inside)
    assert num == len(tokens) and at == 11 * BLOCK + 5
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 3, step=BLOCK)
    got = grow(model, restored, asked[num:], 3, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 4
    got = prefill(model, inside[at:], part, step=BLOCK)
    assert max_diff(got, live_logits(model, inside, at, step=BLOCK)) == 0.0
    # the control: a block of the other fetch in its place gives other logits
    wrong = make_prompt_cache(model)
    prefill(model, asked[:num], wrong, step=BLOCK)
    wrong[0] = part[0]
    assert max_diff(grow(model, wrong, asked[num:], 0, step=BLOCK)[0], want[0]) > 0.0


@pytest.mark.parametrize("growth", [0.0, 0.5])
def test_growth_0_keeps_every_run_its_tokens_and_the_default_grows_them(tmp_path, growth):
    """The control; and the default growth, 0.5: runs from twice ``ssd_run_tokens`` on grow."""
    model = tiny_model("llama")
    tokens = prompt(3, 12 * BLOCK)
    cfg = ssd_config(tmp_path, ssd_run_tokens=2 * BLOCK, ssd_run_growth=growth)
    assert CacheConfig().ssd_run_growth == 0.5
    with PrefixCache(model, cfg, model_id="t") as pc:
        assert pc.fetch(tokens)[1] == 0
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, step=BLOCK)
        pc.store(tokens, cache)
        pc.flush()
        # growing: runs from blocks 0, 2, 4, then 6 (96 tokens before: 48) and 9 (3 left)
        want = [2] * 12 if not growth else [2] * 6 + [3] * 6
        assert [r.count for r in runs_of(pc)] == want


WINDOW = ("0.", "2.")  # gemma3_text's window layers (window 16)


def stored_windows(tmp_path, block: int):
    """gemma3_text's chain of 12 blocks, prefilled in one chunk (every block keeps its
    window K/V), in run files of four blocks; the cache and the chain."""
    model = tiny_model("gemma3_text")
    tokens = prompt(21, 12 * block)
    cfg = ssd_config(tmp_path, block_size=block, ssd_run_tokens=4 * block)
    pc = PrefixCache(model, cfg, model_id="t")
    assert pc.fetch(tokens)[1] == 0
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=len(tokens))
    pc.store(tokens, cache)
    pc.flush()
    return pc, model, tokens


def window_names(pc, key: bytes) -> list[str]:
    _, spans = spans_of(payload(pc, key), key)
    return [s[0] for s in spans if s[0].startswith(WINDOW)]


def corrupt(pc) -> int:
    return pc.tiers.named("ssd").stats()["num_corrupt"]


def test_a_window_one_block_holds_stays_whole_per_block_and_only_the_last_is_read(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(digests, "MIN_SKIP", 0)  # the tiny model's skips are small
    pc, model, tokens = stored_windows(tmp_path, BLOCK)
    with pc:
        assert pc.layout.whole_windows == WINDOW
        last = runs_of(pc)[-1].file_key
        names = window_names(pc, last)
        assert names and all(run_layout.split_extra(n) for n in names)  # extras, not joined
        flip_in(payload(pc, last), last, "0.keys@1")  # block 9's: before the last block
        apart = []
        real = checked._verify_apart
        monkeypatch.setattr(
            checked, "_verify_apart", lambda *a: apart.append(real(*a)) or apart[-1]
        )
        asked = tokens + prompt(22, 7)
        restored, num = pc.fetch(asked)
        assert num == len(tokens) and corrupt(pc) == 0 and True in apart  # never read
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=len(tokens))
    want = grow(model, live, asked[num:], 3, step=BLOCK)
    got = grow(model, restored, asked[num:], 3, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 4


def test_a_byte_flipped_in_the_last_blocks_window_fails_the_run_files_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(digests, "MIN_SKIP", 0)
    pc, _, tokens = stored_windows(tmp_path, BLOCK)
    with pc:
        last = runs_of(pc)[-1].file_key
        flip_in(payload(pc, last), last, "0.keys@3")  # block 11's: the fetch uses it
        assert pc.fetch([*tokens, 1])[1] == 8 * BLOCK  # the last run file's blocks missed
        assert corrupt(pc) == 4


def test_a_window_longer_than_a_block_stays_joined(tmp_path):
    pc, _, _ = stored_windows(tmp_path, 8)
    with pc:
        assert pc.layout.whole_windows == ()
        last = runs_of(pc, 8)[-1].file_key
        names = window_names(pc, last)
        assert names and not any(run_layout.split_extra(n) for n in names)
