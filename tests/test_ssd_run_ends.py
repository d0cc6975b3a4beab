"""A chain's last blocks that a window layer needs get a run file of their own.

gemma3_text (window 16) at block 8 needs its window layers' K/V of a chain's
last two blocks. Prefilled in one chunk, every block keeps window K/V, joined on
the token axis with its run's. Where the chain's last run is short of a whole
run and holds twice those blocks at least, the writer puts them in a file of
their own (``window_blocks``), so a fetch of the whole chain reads that file
whole and of the file before it only the full layers' K/V: a byte flipped in
that file's window K/V is never read, and the restore is exact and grows. The
control: without the split, the same byte lies in the last run file, whose
window K/V the fetch reads for its last blocks, and it fails the file's blocks.
A whole last run (where the writer's batch was cut: the chain may go on) and a
short one stay one file.

The lookup asks for the window's blocks' payload names (whether they keep window
K/V) from their file's header: each file's header is read once while the
checksum its blocks' entries name holds, the next lookups read none (the
control: with the kept headers cleared, they are read again).
"""

from __future__ import annotations

from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_ssd_run_files import payload, runs_of, ssd_config
from test_ssd_run_growth import items
from test_ssd_run_skips import corrupt, flip_placed, grows_like_the_live_run, stored

from prefixcache import PrefixCache
from prefixcache.tiers.run_length import RunHints
from prefixcache.tiers.ssd import reads, runfiles

BLOCK = 8
RUN = 6  # blocks
TOKENS = 11 * BLOCK  # runs of six blocks: 6 and a short one of 5


def test_the_writer_puts_a_chains_last_window_blocks_in_a_file_of_their_own():
    batch = items(11)
    ends = {batch[0].block.root: RunHints(window_blocks=2, windows=("1.",))}
    assert [len(r) for r in runfiles.group(batch, 96, 0.0, ends)] == [6, 3, 2]
    assert [len(r) for r in runfiles.group(batch, 96)] == [6, 5]  # the control
    whole = items(12)  # a whole last run: as is
    assert [len(r) for r in runfiles.group(whole, 96, 0.0, ends)] == [6, 6]
    short = items(9)  # a last run shorter than twice the window's blocks: as is
    assert [len(r) for r in runfiles.group(short, 96, 0.0, ends)] == [6, 3]
    unjoined = {batch[0].block.root: RunHints(window_blocks=2, windows=("2.",))}
    assert [len(r) for r in runfiles.group(batch, 96, 0.0, unjoined)] == [6, 5]  # not in the run


def test_a_chains_window_blocks_alone_leave_the_file_before_unread_behind_its_full_layers(
    tmp_path,
):
    pc, model, tokens = stored(tmp_path, TOKENS, RUN * BLOCK, 31)
    with pc:
        assert pc.layout.run_hints.window_blocks == 2
        runs = runs_of(pc, BLOCK)
        assert [r.count for r in runs] == [6] * 6 + [3] * 3 + [2] * 2
        before = runs[6].file_key  # blocks 6-8, before the window's two
        flip_placed(payload(pc, before), before, "2.values", 0)  # a window layer's, last
        asked = tokens + prompt(32, 5)
        restored, num = pc.fetch(asked)
        assert num == TOKENS and corrupt(pc) == 0  # never read
        rest = asked[num:] + prompt(33, 13)  # past the restored length, then decode
        assert grows_like_the_live_run(model, tokens, restored, rest)


def test_without_the_split_the_same_byte_is_read_and_fails_the_last_run(tmp_path, monkeypatch):
    monkeypatch.setattr(runfiles, "_split_end", lambda run, *rest: runfiles._cut(run))
    pc, _, tokens = stored(tmp_path, TOKENS, RUN * BLOCK, 31)
    with pc:
        runs = runs_of(pc, BLOCK)
        assert [r.count for r in runs] == [6] * 6 + [5] * 5
        last = runs[6].file_key  # blocks 6-10: block 6's part leads each row
        flip_placed(payload(pc, last), last, "2.values", 0)
        assert pc.fetch([*tokens, 1])[1] == 6 * BLOCK  # the blocks before it
        assert corrupt(pc) == 5  # the file quarantined: its five blocks


def test_a_lookup_reads_each_files_header_once(tmp_path, monkeypatch):
    pc, _, tokens = stored(tmp_path, TOKENS, RUN * BLOCK, 31)
    with pc:
        read = reads.read_header
        asked: list[bytes] = []

        def spy(path, key):
            asked.append(key)
            return read(path, key)

        monkeypatch.setattr(reads, "read_header", spy)
        assert pc.match([*tokens, 1]) == TOKENS
        first = list(asked)
        assert first and len(set(first)) == len(first)  # each file's once
        assert runs_of(pc, BLOCK)[-1].file_key in first  # the window's blocks' file
        asked.clear()
        assert pc.match([*tokens, 1]) == TOKENS
        assert asked == []  # kept
        pc.tiers.named("ssd").reads._headers.clear()  # the control
        assert pc.match([*tokens, 1]) == TOKENS
        assert sorted(asked) == sorted(first)


def test_a_chain_whose_window_rolled_keeps_its_last_run_whole(tmp_path):
    """Decoded since its prefill, the cache's window layers hold their last 16 tokens
    only: the last blocks keep window K/V as extras (read apart already), no split."""
    model = tiny_model("gemma3_text")
    tokens = prompt(34, TOKENS)
    cfg = ssd_config(tmp_path, block_size=BLOCK, ssd_run_tokens=RUN * BLOCK)
    with PrefixCache(model, cfg, model_id="t") as pc:
        assert pc.fetch(tokens)[1] == 0  # its quiet window: one writer batch
        cache = make_prompt_cache(model)
        prefill(model, tokens[:-3], cache, step=TOKENS)
        prefill(model, tokens[-3:], cache, step=1)  # one token at a time: the window rolls
        pc.store(tokens, cache)
        pc.flush()
        assert [r.count for r in runs_of(pc, BLOCK)] == [6] * 6 + [5] * 5
        restored, num = pc.fetch([*tokens, *prompt(35, 5)])
        assert num == TOKENS and corrupt(pc) == 0
        live = make_prompt_cache(model)  # the same chunks: the same sums
        prefill(model, tokens[:-3], live, step=TOKENS)
        prefill(model, tokens[-3:], live, step=1)
        got = prefill(model, prompt(35, 5), restored, step=4)
        assert max_diff(got, prefill(model, prompt(35, 5), live, step=4)) == 0.0
