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

The last run file's window K/V are used by its last blocks only (no region
holds all the run's blocks): each block's part goes straight into its own
place, never through a loose buffer, the run's blocks before the window are
handed over as the run's regions (as every other run file's blocks: checked
once), and the restore is exact and grows. A
byte flipped in such a placed part fails the file's blocks; with the per-block
places turned off the same tensors go through the loose buffer (the control
that the observation tells the two apart).
"""

from __future__ import annotations

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_restore_grows import grow
from test_ssd_digests import flip_in, spans_of
from test_ssd_run_files import payload, runs_of, ssd_config

from prefixcache import PrefixCache
from prefixcache.memory.host import PlacedRun
from prefixcache.tiers.ssd import readers, run_reads
from prefixcache.tiers.ssd.block_places import BlockPlaces

BLOCK = 8
RUN = 4 * BLOCK
TOKENS = 12 * BLOCK  # three run files
WINDOW = {"0.keys", "0.values", "2.keys", "2.values"}  # layers 0 and 2 (window 16: 2 blocks)


def stored(tmp_path, num_tokens: int = TOKENS, run_tokens: int = RUN, seed: int = 21):
    """A PrefixCache holding the chain (by default in three run files), and the chain."""
    model = tiny_model("gemma3_text")
    tokens = prompt(seed, num_tokens)
    cfg = ssd_config(tmp_path, block_size=BLOCK, ssd_run_tokens=run_tokens)
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


def spy_reads(monkeypatch) -> tuple[list[set[str]], dict[int, dict[str, str]]]:
    """(per run file read, the names it put in loose buffers; block index -> its
    tensors' kinds as the run file read handed them over)."""
    loose: list[set[str]] = []
    kinds: dict[int, dict[str, str]] = {}
    init, read = run_reads._Loose.__init__, readers.read_run_file

    def loose_spy(self, tensors, *args):
        loose.append(set(tensors))
        init(self, tensors, *args)

    def read_spy(jobs, *args):
        for lent, block in read(jobs, *args):
            if not isinstance(block, Exception):
                a = block.arrays
                kinds[block.index] = {
                    n: "PlacedRun" if type(a) is PlacedRun else type(a[n]).__name__ for n in a
                }
            yield lent, block

    monkeypatch.setattr(run_reads._Loose, "__init__", loose_spy)
    monkeypatch.setattr(readers, "read_run_file", read_spy)
    return loose, kinds


def flip_placed(path: str, key: bytes, name: str, quarters: int = 3) -> None:
    """Invert a byte of tensor ``name`` of a run file in its first (batch, head) row,
    ``quarters`` of the row in (3 of four blocks: the last block's part, bytes read
    into their place; 0: the first block's)."""
    prefix, spans = spans_of(path, key)
    _, _, shape, start, end = next(s for s in spans if s[0] == name)
    row = (end - start) // (shape[0] * shape[1])
    at = len(prefix) + start + row * quarters // 4 + 5
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_last_run_files_window_tensors_go_straight_into_their_blocks_places(
    tmp_path, monkeypatch
):
    pc, model, tokens = stored(tmp_path)
    with pc:
        loose, kinds = spy_reads(monkeypatch)
        asked = tokens + prompt(24, 5)
        restored, num = pc.fetch(asked)
        assert num == TOKENS and corrupt(pc) == 0
        assert loose == [set()] * 3, loose  # no run file read a tensor into a loose buffer
        assert sorted(kinds) == list(range(12))
        for i in (10, 11):  # the window's blocks: their window K/V each in its place
            assert {n: kinds[i][n] for n in WINDOW} == dict.fromkeys(WINDOW, "Placed")
            assert set(kinds[i].values()) == {"Placed"}, kinds[i]
        for i in (8, 9):  # before the window: full layers only, as the run's other blocks
            assert not WINDOW & set(kinds[i]) and set(kinds[i].values()) == {"PlacedRun"}
        rest = asked[num:] + prompt(25, 13)  # past the restored length, then decode
        assert grows_like_the_live_run(model, tokens, restored, rest)


def grows_like_the_live_run(model, tokens: list[int], restored: list, rest: list[int]) -> bool:
    """Whether ``restored`` (holding ``tokens``) prefills ``rest`` and decodes six steps
    with the logits of a cache that prefilled ``tokens`` in one chunk, bit for bit."""
    live = make_prompt_cache(model)
    prefill(model, tokens, live, step=len(tokens))
    want = grow(model, live, rest, 6, step=4)
    got = grow(model, restored, rest, 6, step=4)
    return [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 7


def test_a_byte_flipped_in_a_placed_window_part_fails_the_run_files_blocks(tmp_path):
    pc, _, tokens = stored(tmp_path)
    with pc:
        last = runs_of(pc, BLOCK)[8].file_key
        flip_placed(payload(pc, last), last, "2.values")
        num = pc.fetch([*tokens, 1])[1]
        assert corrupt(pc) == 4  # the file quarantined: its four blocks
        assert num == 8 * BLOCK  # the blocks before it restored


def test_without_the_blocks_places_the_window_tensors_go_through_a_loose_buffer(
    tmp_path, monkeypatch
):
    """The control of the observation: the per-block places turned off, the last run
    file's window K/V are read loose (then copied into the same places), still exact."""
    pc, model, tokens = stored(tmp_path)
    with pc:
        monkeypatch.setattr(BlockPlaces, "take", lambda *args: None)
        loose, kinds = spy_reads(monkeypatch)
        restored, num = pc.fetch(tokens + prompt(24, 5))
        assert num == TOKENS
        assert sorted(loose, key=len) == [set(), set(), WINDOW], loose  # the last file's
        assert all(kinds[i][n] == "Placed" for i in (10, 11) for n in WINDOW)
        live = make_prompt_cache(model)
        prefill(model, tokens, live, step=TOKENS)
        got = prefill(model, prompt(24, 5), restored, step=4)
        assert max_diff(got, prefill(model, prompt(24, 5), live, step=4)) == 0.0
