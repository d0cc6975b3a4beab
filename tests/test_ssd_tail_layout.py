"""Payload files end with what a restore mostly skips; window and hybrid chains
restored from SSD out of files of either tensor order equal the live run.

Tiny gemma3_text (window layers 0 and 2 beside global layers 1 and 3) and
qwen3_next (gated-delta-net layers 0 and 2 beside attention layers 1 and 3),
8-token blocks, a chain stored from one prefill chunk: every block holds the
window layers' K/V, the last one the recurrent state. The writer lists the
layers whose payloads only some blocks keep (window K/V, recurrent state) after
the others (``cache/capture.py``), so a restore past the window reads one
stretch of each file; files with every layer in layer order (as written
before) still read, alone or mixed with the new ones in one chain. Bytes read
are counted by the kernel (``rchar``: every read of every thread).
"""

from __future__ import annotations

import os

import pytest
from conftest import max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache import capture
from prefixcache.hashing import chain_keys, token_bytes
from prefixcache.tiers.ssd import payload
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd.files import payload_path

BLOCK = 8
STORED = 12 * BLOCK  # the window (16 tokens) reaches back two blocks
HALF = 6 * BLOCK


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_next"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(params=["runs", "large"])
def path_kind(request, monkeypatch):
    """Every payload through the small-file runs, or through the large-file reads."""
    if request.param == "large":
        monkeypatch.setattr(ssd_runs, "SMALL_READ", 0)
    return request.param


def partial(model) -> set[int]:
    """The layers whose payloads only some blocks keep (a window, a recurrent state)."""
    kinds = (RotatingKVCache, ArraysCache)
    return {i for i, c in enumerate(make_prompt_cache(model)) if isinstance(c, kinds)}


def ssd_only(model, tmp_path) -> PrefixCache:
    config = CacheConfig(
        ssd_run_tokens=0,
        block_size=BLOCK,
        hot_max_bytes=1,  # every block on SSD only
        promote=False,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
    )
    return PrefixCache(model, config, model_id="t")


def store(pc: PrefixCache, model, tokens: list[int], layer_order: bool, monkeypatch) -> None:
    """Store ``tokens`` from one prefill chunk; ``layer_order``: as written before
    (every layer's tensors in layer order)."""
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=len(tokens))
    with monkeypatch.context() as m:
        if layer_order:
            m.setattr(capture, "partial_layers", lambda reaches, length: frozenset())
        pc.store(tokens, cache)
        pc.flush()


def chain_layers(pc: PrefixCache, tokens: list[int]) -> list[list[int]]:
    """Each chain file's tensors' layers, in file order."""
    keys = chain_keys(pc.namespace.root_key(), token_bytes(tokens), BLOCK)
    out = []
    for key in keys:
        fd = os.open(payload_path(os.path.join(pc.ssd.path, "blocks"), key), os.O_RDONLY)
        try:
            _, spans = payload.read_spans(fd, key, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        out.append([int(name.split(".")[0]) for name, *_ in spans])
    return out


def chain_bytes(pc: PrefixCache) -> int:
    blocks = os.path.join(pc.ssd.path, "blocks")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(blocks) for f in fs)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("order", ["tail-last", "layer-order"])
def test_the_layers_a_restore_mostly_skips_end_each_file(model, tmp_path, monkeypatch, order):
    """Written now, every file lists the other layers first, in layer order, then
    the window and state layers; written as before (the control), in layer order."""
    shared = prompt(1, STORED)
    late = partial(model)
    with ssd_only(model, tmp_path) as pc:
        store(pc, model, shared, order == "layer-order", monkeypatch)
        files = chain_layers(pc, shared)
    assert len(files) == STORED // BLOCK
    assert any(set(layers) & late for layers in files)
    for layers in files:
        seen = list(dict.fromkeys(layers))  # each layer once, in file order
        if order == "layer-order":
            assert seen == sorted(seen)
        else:
            head = [i for i in seen if i not in late]
            assert seen == sorted(head) + sorted(set(seen) & late), seen
    if order == "tail-last":  # the last block ends with the window or the state
        assert files[-1][-1] in late


@pytest.mark.parametrize("order", ["tail-last", "layer-order", "mixed"])
def test_restores_from_files_of_either_order_grow_with_the_live_logits(
    model, tmp_path, monkeypatch, path_kind, order
):
    """A restore at 96 of 96 + 29 asked tokens, then a prefill past it and greedy
    decode steps: the live run's logits bit for bit, whatever order the files have
    ("mixed": blocks 0-5 in layer order, 6-11 tail-last: one run of files, read
    whole as its first file is). Files in tail-last order are read in part (the
    window K/V behind the window is never read, though the run of files 1-11
    reaches into the window), in layer order whole (its unneeded stretches are
    too short to skip). The control: the
    restored state (or the window's last block) changed gives other logits."""
    shared = prompt(1, STORED)
    asked = shared + prompt(3, 29)
    with ssd_only(model, tmp_path) as pc:
        if order == "mixed":
            store(pc, model, shared[:HALF], True, monkeypatch)
        store(pc, model, shared, order == "layer-order", monkeypatch)
        total = chain_bytes(pc)
        pc.fetch(asked)  # the first restore's imports read files too
        before = rchar()
        cache, num = pc.fetch(asked)
        read = rchar() - before
        bad, _ = pc.fetch(asked)
        assert pc.stats()["ssd"]["num_corrupt"] == 0
    assert num == STORED

    live = make_prompt_cache(model)
    prefill(model, shared, live, step=STORED)
    want = grow(model, live, asked[num:], 5, step=BLOCK)
    got = grow(model, cache, asked[num:], 5, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 6

    if order == "layer-order":
        assert read >= total
    elif order == "tail-last" and model.args.model_type == "gemma3_text":
        assert read < 0.8 * total  # files 0-9 skip their window K/V

    c = bad[min(partial(model))]
    if type(c) is RotatingKVCache:
        c.keys[..., -BLOCK:, :] = c.keys[..., -BLOCK:, :] * 0.5
    else:
        c[1] = c[1] * 0.5
    wrong = grow(model, bad, asked[num:], 5, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["used data", "lead digest", "window data"])
def test_one_lead_digest_verifies_the_stretch_a_restore_reads(tmp_path, monkeypatch, where):
    """Block 4 of a tail-last gemma3_text chain, behind the window of a restore at
    96: its global layers' K/V lead the file and are read in one stretch, verified
    against the lead digest of the last of them. A byte changed in that data, or
    a digit of that lead digest (which no other check reads: the control that the
    lead digest is what verifies), makes the block a miss; one changed in the
    window K/V after it is never read: the restore is whole. Exact either way."""
    model = tiny_model("gemma3_text")
    shared = prompt(1, STORED)
    asked = shared + prompt(3, 29)
    with ssd_only(model, tmp_path) as pc:
        store(pc, model, shared, False, monkeypatch)
        key = chain_keys(pc.namespace.root_key(), token_bytes(shared), BLOCK)[4]
        path = payload_path(os.path.join(pc.ssd.path, "blocks"), key)
        fd = os.open(path, os.O_RDONLY)
        try:
            prefix, spans = payload.read_spans(fd, key, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        late = [s for s in spans if int(s[0].split(".")[0]) in partial(model)]
        last_used = spans[len(spans) - len(late) - 1]
        if where == "used data":
            flip(path, len(prefix) + last_used[3])
        elif where == "window data":
            flip(path, len(prefix) + late[0][3])
        else:
            entry = prefix.index(f'"{last_used[0]}":'.encode())
            at = prefix.index(b'"lead":"', entry) + len(b'"lead":"')
            digit = b"1" if prefix[at : at + 1] == b"0" else b"0"
            with open(path, "r+b") as f:
                f.seek(at)
                f.write(digit)
        cache, num = pc.fetch(asked)
        corrupt = pc.stats()["ssd"]["num_corrupt"]
    missed = where != "window data"
    assert (num, corrupt) == ((4 * BLOCK, 1) if missed else (STORED, 0))
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=max(num, 1))
    want = grow(model, live, asked[num:], 2, step=BLOCK)
    got = grow(model, cache, asked[num:], 2, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 3
