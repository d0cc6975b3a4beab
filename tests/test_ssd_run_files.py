"""Run files: consecutive blocks of a chain kept in one SSD payload file.

A chain stored through the SSD tier with ``ssd_run_tokens`` is written as run
files (each tensor its blocks' tensors one after another on the token axis);
restored from them (SSD only, or hot and SSD together, plain and quantized K/V)
it gives the live run's logits bit for bit and grows like it. A prompt that
leaves the chain inside a run reads and verifies the file and places only the
blocks it uses. The index counts a run file's bytes once and unlinks it with
its last block, so the disk never holds more than ``ssd_max_bytes``; a damaged
run file fails every one of its blocks; a pin keeps it; ``gc`` and ``verify``
know run files; an index written before run files opens and serves. The
controls: one restored block changed gives other logits; ``ssd_run_tokens=0``
writes one file per block.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import live_logits, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from ssd_child import block_key, check_block, make_block
from test_restore_grows import grow

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cli import main
from prefixcache.memory.host import tensors_of
from prefixcache.tiers.ssd import run_layout, run_reads, runfiles
from prefixcache.tiers.ssd.admin.maintenance import reconcile, verify
from prefixcache.tiers.ssd.admin.view import SsdView
from prefixcache.tiers.ssd.files import payload_path
from prefixcache.tiers.ssd.index import SsdIndex
from prefixcache.tiers.ssd.payload import read_header
from prefixcache.tiers.ssd.stream import stream
from prefixcache.tiers.ssd.tier import SsdTier
from prefixcache.tiers.writer import WriteItem

BLOCK = 16
RUN = 4 * BLOCK  # run files of four blocks
KV = (8, 32, 0)  # bits, group size, quantized from the start
V2_INDEX = Path(__file__).parent / "data" / "ssd_v2"  # written by format 2 (no run files)


def ssd_config(tmp_path, kv=None, **over) -> CacheConfig:
    """Every block on the SSD tier only, run files of four blocks."""
    cfg = CacheConfig(
        block_size=BLOCK,
        hot_max_bytes=1,
        promote=False,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        write_queue_bytes=1 << 30,
        ssd_run_tokens=RUN,
        ssd_run_growth=0.0,  # every run four blocks (tests/test_ssd_run_growth.py: growing)
        background_quiet_ms=60_000,  # a store after a fetch is written by the flush at once
    )
    if kv is not None:
        cfg = cfg.replace(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    return cfg.replace(**over)


def runs_of(pc: PrefixCache, block_size: int = BLOCK) -> list:
    """The run reference (or None) of each full block of the one chain the SSD tier
    holds, in chain order."""
    ssd = pc.tiers.named("ssd")
    metas = sorted(
        (m for m in ssd.iter_meta() if m.num_tokens == block_size), key=lambda m: m.index
    )
    return [run for _, run in ssd.index.get_runs([m.key for m in metas])]


def payload(pc: PrefixCache, key: bytes) -> str:
    return pc.tiers.named("ssd").reads.payload_file(key)


def files_on_disk(path) -> list[str]:
    root = os.path.join(path, "blocks")
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def store(pc: PrefixCache, model, tokens: list[int], kv=None) -> None:
    """Store ``tokens``' blocks in one writer batch: the miss's quiet window holds the
    writer until the flush."""
    assert pc.fetch(tokens)[1] == 0
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK, kv=kv)
    pc.store(tokens, cache)
    pc.flush()


@pytest.mark.parametrize("kv", [None, KV], ids=["plain", "quantized"])
@pytest.mark.parametrize("where", ["ssd", "hot+ssd"])
def test_a_chain_from_run_files_restores_exactly_and_grows(tmp_path, where, kv):
    model = tiny_model("llama", head_dim=32)  # a quantization group of 32
    tokens = prompt(1, 10 * BLOCK + 5)
    asked = tokens[: 10 * BLOCK] + prompt(2, 40)
    with PrefixCache(model, ssd_config(tmp_path, kv), model_id="t") as pc:
        store(pc, model, tokens, kv)
        runs = runs_of(pc)
        assert [r.count for r in runs[:8]] == [4] * 8 and runs[0].file_key != runs[4].file_key
        assert [r.position for r in runs[:8]] == [0, 1, 2, 3] * 2
        assert len(files_on_disk(tmp_path / "ssd")) < 10  # 2 run files, then blocks 8, 9, tail
    hot = 64 << 20 if where == "hot+ssd" else 1
    again = ssd_config(
        tmp_path, kv, hot_max_bytes=hot, promote=where == "hot+ssd", background_quiet_ms=0
    )
    with PrefixCache(model, again, model_id="t") as pc:
        if where == "hot+ssd":  # blocks 0 and 1 promoted: the restore starts inside a run
            pc.fetch(tokens[: 2 * BLOCK + 1])
            assert pc.prefetcher.join(timeout=60)
            assert pc.stats()["hot"]["num_blocks"] == 2
        (cache, num), (bad, _) = pc.fetch(asked), pc.fetch(asked)
    assert num == 10 * BLOCK
    if kv is not None:
        assert all(type(c) is QuantizedKVCache for c in cache)
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK, kv=kv)
    want = grow(model, live, asked[num:], 4, step=BLOCK)
    got = grow(model, cache, asked[num:], 4, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5

    # the control: block 5 (inside the second run file) of one layer changed
    layer = bad[1]
    keys = layer.keys[0] if kv is not None else layer.keys
    keys[..., 5 * BLOCK : 6 * BLOCK, :] = keys[..., 5 * BLOCK : 6 * BLOCK, :] + 1
    wrong = grow(model, bad, asked[num:], 4, step=BLOCK)
    assert max_diff(wrong[0], want[0]) > 0.0


def test_a_prompt_leaving_the_chain_inside_a_run_uses_its_first_blocks(tmp_path):
    model = tiny_model("llama")
    tokens = prompt(3, 8 * BLOCK + 3)
    asked = tokens[: 6 * BLOCK + 5] + prompt(4, 30)  # inside block 6: run 2's third block
    with PrefixCache(model, ssd_config(tmp_path), model_id="t") as pc:
        store(pc, model, tokens)
        assert [r.position for r in runs_of(pc)] == [0, 1, 2, 3] * 2
        cache, num = pc.fetch(asked)
        loads = pc.tiers.named("ssd").stats()["num_loads"]
    assert num == 6 * BLOCK + 5  # block 6 restored and cut back to the common tokens
    assert loads >= 7
    got = prefill(model, asked[num:], cache, step=BLOCK)
    assert max_diff(got, live_logits(model, asked, num, step=BLOCK)) == 0.0


def test_blocks_read_alone_or_from_the_middle_of_a_run_are_exact(tmp_path):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 5, 8)
        assert [r.position for _, r in tier.index.get_runs(keys)] == [0, 1, 2, 3] * 2
        for i in (2, 7):
            check_block(tier.load(keys[i]))
        out = [b.to_block() for b in stream(tier.reads, keys[2:7])]  # positions 2-3, then 0-2
        assert [b.index for b in out] == [2, 3, 4, 5, 6]
        for block in out:
            check_block(block)


def test_window_blocks_share_run_files_with_their_window_payload_as_extras(tmp_path):
    """gemma3_text stored in two prefill chunks: the first chunk's blocks lose their
    window layers' payload, the rest keep it: they share run files all the same, the
    window K/V kept whole per block (extras), and restore exactly."""
    model = tiny_model("gemma3_text")
    tokens = prompt(6, 12 * BLOCK + 3)
    cfg = ssd_config(tmp_path, block_size=8, ssd_run_tokens=32)
    with PrefixCache(model, cfg, model_id="t") as pc:
        assert pc.fetch(tokens)[1] == 0  # its quiet window: one writer batch (``store``)
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, step=64)
        pc.store(tokens, cache)
        pc.flush()
        runs = runs_of(pc, 8)
        assert all(r is not None for r in runs) and len({r.file_key for r in runs}) == 24 // 4
        names = [n for r in runs for n, *_ in read_header(payload(pc, r.file_key), r.file_key)]
        assert any(run_layout.split_extra(n) for n in names)  # window K/V of some blocks
        asked = tokens + prompt(7, 20)
        restored, num = pc.fetch(asked)
    assert num == len(tokens)
    got = prefill(model, asked[num:], restored, step=8)
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=64)
    assert max_diff(got, prefill(model, asked[num:], live, step=8)) == 0.0


# -- the tier: files, bytes, damage, pins, maintenance ------------------------------


def tier_config(tmp_path, **over) -> CacheConfig:
    base = CacheConfig(
        ssd_dir=str(tmp_path / "ssd"),
        ssd_max_bytes=1 << 30,
        ssd_min_free_bytes=0,
        queue_full="inline",
        ssd_run_tokens=RUN,
    )
    return base.replace(**over)


def put_chain(tier: SsdTier, seed: int, count: int) -> list[bytes]:
    """Blocks 0 to ``count`` of chain ``seed`` (16 tokens each), written in one batch."""
    blocks = [make_block(seed, i) for i in range(count)]
    tier.writer.run_inline([WriteItem(b, tensors_of(b.arrays), b.nbytes) for b in blocks])
    return [b.key for b in blocks]


def disk_bytes(tmp_path) -> int:
    return sum(os.stat(f).st_size for f in files_on_disk(tmp_path / "ssd"))


def test_run_tokens_0_writes_a_file_per_block(tmp_path):
    with SsdTier(tier_config(tmp_path / "a", ssd_run_tokens=0)) as tier:
        put_chain(tier, 8, 8)
        assert len(files_on_disk(tmp_path / "a" / "ssd")) == 8
    with SsdTier(tier_config(tmp_path / "b")) as tier:
        keys = put_chain(tier, 8, 8)
        assert len(files_on_disk(tmp_path / "b" / "ssd")) == 2
        assert tier.stats()["nbytes"] == disk_bytes(tmp_path / "b")
        assert tier.stats()["num_blocks"] == 8
        for key in keys:
            check_block(tier.load(key))


def test_the_batch_groups_consecutive_blocks_whatever_their_order():
    blocks = [make_block(9, i) for i in range(7)]
    branch = make_block(10, 3, parent=blocks[2].key)  # a second child of block 2
    tail = dataclasses.replace(make_block(9, 7), tokens=blocks[0].tokens[:12])  # fewer tokens
    items = [WriteItem(b, tensors_of(b.arrays), b.nbytes) for b in [*blocks, branch, tail]]
    order = [items[i] for i in (6, 5, 8, 4, 3, 2, 7, 1, 0)]  # evicted leaves first
    groups = runfiles.group(order, RUN)
    assert sorted(len(g) for g in groups) == [1, 1, 3, 4]
    chains = [[it.block.index for it in g] for g in groups if len(g) > 1]
    assert sorted(chains) == [[0, 1, 2, 3], [4, 5, 6]]
    assert all(it.block.parent == prev.block.key for g in groups for prev, it in pairwise(g))
    assert runfiles.group(order, 0) == [[it] for it in order]


def test_a_run_file_goes_with_its_last_block_and_the_disk_stays_under_the_cap(tmp_path):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 11, 4)
        (path,) = files_on_disk(tmp_path / "ssd")
        size = os.path.getsize(path)
        assert tier.stats()["nbytes"] == size
        for left in (3, 2, 1):  # the chain's leaf goes: no byte freed yet
            assert tier.remove([keys[left]]) == 1
            assert os.path.exists(path) and tier.stats()["nbytes"] == size
            assert tier.stats()["num_blocks"] == left
            check_block(tier.load(keys[left - 1]))
        assert tier.remove([keys[0]]) == 1
        assert not os.path.exists(path) and tier.stats()["nbytes"] == 0
        keys = put_chain(tier, 11, 4)
        assert tier.evict_to(size - 1) == 4  # leaves go until the file's bytes are freed
        assert not os.path.exists(path) and tier.stats()["nbytes"] == 0

    cap = int(2.5 * size)
    with SsdTier(tier_config(tmp_path / "cap", ssd_max_bytes=cap)) as tier:
        for seed in range(20, 30):
            put_chain(tier, seed, 4)
            assert disk_bytes(tmp_path / "cap") == tier.stats()["nbytes"] <= cap
        assert len(files_on_disk(tmp_path / "cap" / "ssd")) == 2
        assert tier.stats()["num_evictions"] == 8 * 4


@pytest.mark.parametrize("read", ["stream", "load"])
def test_a_flipped_byte_in_a_run_file_fails_all_its_blocks(tmp_path, read):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 12, 8)
        run = tier.index.get_runs(keys[:1])[0][1]
        path = payload_path(os.path.join(tier.path, "blocks"), run.file_key)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        if read == "stream":
            out = [b if b is None else b.to_block() for b in stream(tier.reads, keys)]
            assert out[:4] == [None] * 4
            for block in out[4:]:
                check_block(block)
        else:
            assert tier.load(keys[2]) is None
        assert tier.stats()["num_corrupt"] == 4
        assert all(tier.get_meta(k) is None for k in keys[:4])
        assert not os.path.exists(path) and tier.stats()["num_blocks"] == 4
        assert tier.stats()["nbytes"] == disk_bytes(tmp_path)


def test_a_pinned_block_keeps_its_run_file(tmp_path):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 13, 4)
        (path,) = files_on_disk(tmp_path / "ssd")
        tier.pin([make_block(13, 1)], until=math.inf)
        assert tier.evict_to(0) == 2  # blocks 3 and 2; block 1 is pinned
        assert os.path.exists(path)
        check_block(tier.load(keys[1]))
        tier.unpin([keys[1]])
        assert tier.evict_to(0) == 2
        assert not os.path.exists(path) and tier.stats()["nbytes"] == 0


def test_gc_keeps_live_run_files_and_removes_orphans_and_verify_checks_them(tmp_path):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 14, 8)
        runs = [r for _, r in tier.index.get_runs(keys)]
        assert reconcile(tier.index) == (0, 0)
        assert len(files_on_disk(tmp_path / "ssd")) == 2
        blocks = os.path.join(tier.path, "blocks")
        orphan = payload_path(blocks, block_key(99, 0))
        os.makedirs(os.path.dirname(orphan), exist_ok=True)
        shutil.copy(payload_path(blocks, runs[0].file_key), orphan)
        assert reconcile(tier.index) == (1, 0)
        for key in keys:
            check_block(tier.load(key))
        view = SsdView(tier.path, writable=False)
        try:
            assert verify(view).ok
            path = payload_path(blocks, runs[4].file_key)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 1)
            assert set(verify(view).bad) == set(keys[4:])
        finally:
            view.close()
        os.unlink(path)
        assert reconcile(tier.index) == (0, 4)  # its four entries dangle
        assert tier.stats()["num_blocks"] == 4 and tier.stats()["nbytes"] == disk_bytes(tmp_path)


def test_verify_quarantine_drops_and_lists_every_block_of_a_bad_run_file(tmp_path):
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 18, 8)
        path = payload_path(
            os.path.join(tier.path, "blocks"), tier.index.get_runs(keys)[5][1].file_key
        )
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    view = SsdView(str(tmp_path / "ssd"), writable=True)
    try:
        report = verify(view, quarantine=True)
        assert set(report.bad) == set(keys[4:])  # the file's four blocks, each named
        assert sorted(report.quarantined) == sorted(keys[4:])  # each once
        assert sorted(k for k, _ in view.index.rows()) == sorted(keys[:4])
    finally:
        view.close()
    assert not os.path.exists(path)
    with SsdTier(tier_config(tmp_path)) as tier:
        assert tier.stats()["num_blocks"] == 4 and tier.stats()["nbytes"] == disk_bytes(tmp_path)
        for key in keys[:4]:
            check_block(tier.load(key))


def test_an_index_written_before_run_files_opens_and_serves(tmp_path):
    path = tmp_path / "ssd"
    shutil.copytree(V2_INDEX, path)
    index = SsdIndex(str(path / "index"), str(path / "blocks"), readonly=True)
    try:
        assert index.format_version == 2
        keys = [k for k, _ in index.rows()]
        assert len(keys) == 6 and all(run is None for _, run in index.get_runs(keys))
    finally:
        index.close()
    with SsdTier(tier_config(tmp_path)) as tier:  # upgraded when opened to write
        assert tier.index.format_version == 3
        old = [block_key(21, i) for i in range(6)]
        assert [b.index for b in stream(tier.reads, old)] == list(range(6))
        for key in old:
            check_block(tier.load(key))
        put_chain(tier, 15, 4)
    with SsdTier(tier_config(tmp_path)) as tier:
        assert tier.stats()["num_blocks"] == 10
        assert tier.stats()["nbytes"] == disk_bytes(tmp_path)
        for key in [*old, *(block_key(15, i) for i in range(4))]:
            check_block(tier.load(key))


def test_the_cli_counts_verifies_and_collects_run_files(tmp_path, capsys):
    d = ("--ssd-dir", str(tmp_path / "ssd"))
    with SsdTier(tier_config(tmp_path)) as tier:
        put_chain(tier, 16, 8)
        put_chain(tier, 17, 3)
    on_disk = disk_bytes(tmp_path)
    assert len(files_on_disk(tmp_path / "ssd")) == 3
    capsys.readouterr()
    assert main(["stats", *d, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_blocks"] == 11 and doc["nbytes"] == on_disk
    assert doc["format"]["version"] == 3
    assert main(["verify", *d, "--no-progress"]) == 0
    assert main(["gc", *d, "--older-than", "0", "--json"]) == 0
    assert files_on_disk(tmp_path / "ssd") == []
    capsys.readouterr()
    assert main(["stats", *d, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nbytes"] == 0


def test_single_block_loads_in_chain_order_read_a_run_file_once(tmp_path, monkeypatch):
    reads = []
    real = run_reads.read_payload
    monkeypatch.setattr(run_reads, "read_payload", lambda *a, **k: reads.append(a) or real(*a, **k))
    with SsdTier(tier_config(tmp_path)) as tier:
        keys = put_chain(tier, 18, 8)
        for key in keys:  # a warm start's or a pin's loads: one block at a time
            check_block(tier.load(key))
        assert len(reads) == 2  # each run file once, dropped after its last block
        check_block(tier.load(keys[1]))
        assert len(reads) == 3  # read again: nothing held once a file's last block went


@pytest.mark.parametrize("hot_at", [[3], [1, 4]], ids=["one_hot_block", "two_hot_blocks"])
def test_hot_blocks_between_a_run_files_blocks_split_its_reads_and_restore_exactly(
    tmp_path, monkeypatch, hot_at
):
    """Blocks held by hot inside a run file's stretch (as promotion leaves them): the
    run file's blocks around them are read as separate jobs, each placed where it
    belongs, the blocks it skips hashed only. The control (block 1 hot): one job
    across the gap places block 2 where block 1's data lie: other logits."""
    model = tiny_model("llama")
    tokens = prompt(32, 8 * BLOCK + 5)
    cfg = ssd_config(tmp_path, hot_max_bytes=64 << 20)
    with PrefixCache(model, cfg, model_id="t") as pc:
        assert pc.fetch(tokens)[1] == 0  # its quiet window: the spills in one writer batch
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache, step=BLOCK)
        pc.store(tokens, cache)
        pc.trim_hot(0)
        pc.flush()
        assert [r.position for r in runs_of(pc)] == [0, 1, 2, 3] * 2
        metas = sorted(pc.ssd.iter_meta(), key=lambda m: (m.num_tokens != BLOCK, m.index))
        keys = [m.key for m in metas[:8]]
        for i in hot_at:
            assert pc.hot.put(pc.ssd.load(keys[i]))
        restored, num = pc.fetch(tokens)
        assert num == 8 * BLOCK + 4
        got = prefill(model, tokens[num:], restored, step=BLOCK)
        want = live_logits(model, tokens, num, step=BLOCK)
        assert max_diff(got, want) == 0.0
        if hot_at == [1, 4]:

            def one_job(a, b, gap):  # any blocks of one file, gaps or not
                return b.run is not None and b.run.file_key == a.run.file_key

            monkeypatch.setattr(run_reads, "same_file", one_job)
            bad, _ = pc.fetch(tokens)
            assert max_diff(prefill(model, tokens[num:], bad, step=BLOCK), want) > 0.0


# -- extras: tensors a block keeps whole (state snapshots, window K/V of some blocks) --


def with_extras(block, i: int):
    """Every other block gets a 3-D state and a 4-D one shaped like its K/V (so only
    its name tells it is not on the token axis of every block)."""
    if i % 2:
        return block
    base = int.from_bytes(block.key[:2], "little")
    conv = mx.arange(24, dtype=mx.float32).reshape(1, 3, 8) + base
    state = mx.arange(256, dtype=mx.float32).reshape(1, 2, 16, 8) * 3 + base
    arrays = {**block.arrays, "9.0": conv, "9.1": state}
    mx.eval(arrays)
    return dataclasses.replace(block, arrays=arrays, nbytes=sum(a.nbytes for a in arrays.values()))


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and mx.array_equal(a.view(mx.uint8), b.view(mx.uint8)).item()


def test_blocks_with_and_without_extras_share_a_run_file_and_read_back_exactly(tmp_path):
    blocks = [with_extras(make_block(80, i), i) for i in range(6)]
    with SsdTier(tier_config(tmp_path, ssd_run_tokens=6 * BLOCK)) as tier:
        items = [WriteItem(b, tensors_of(b.arrays), b.nbytes) for b in blocks]
        tier.writer.run_inline(items)
        keys = [b.key for b in blocks]
        runs = [r for _, r in tier.index.get_runs(keys)]
        assert [r.position for r in runs] == list(range(6)) and len({r.file_key for r in runs}) == 1
        names = [
            n for n, *_ in read_header(tier.reads.payload_file(runs[0].file_key), runs[0].file_key)
        ]
        assert sorted(n for n in names if "@" in n) == sorted(
            f"9.{s}@{j}" for j in (0, 2, 4) for s in (0, 1)
        )
        streamed = {b.key: b.to_block() for b in stream(tier.reads, keys[1:5])}  # one job
        for i, want in enumerate(blocks):
            got = [tier.load(want.key)] + ([streamed[want.key]] if 1 <= i < 5 else [])
            assert {n for n, *_ in tier.reads.header(want.key)} == set(want.arrays)
            for block in got:
                assert set(block.arrays) == set(want.arrays)
                for name, a in want.arrays.items():
                    assert same_bits(block.arrays[name], a), (i, name)
        # the control: another block's state differs (what was compared could fail)
        assert not same_bits(blocks[0].arrays["9.1"], blocks[2].arrays["9.1"])
        view = SsdView(tier.path, writable=False)
        try:
            assert verify(view).ok  # the blocks' bytes differ: the checksum covers them
            path = tier.reads.payload_file(runs[0].file_key)
            with open(path, "r+b") as f:  # one byte of block 4's extra flipped
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            assert set(verify(view).bad) == set(keys)
        finally:
            view.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "falcon_h1"])
def test_a_hybrid_chain_with_snapshots_in_run_files_restores_exactly_and_grows(tmp_path, arch):
    model = tiny_model(arch)
    tokens = prompt(8, 8 * BLOCK + 5)
    asked = tokens[: 6 * BLOCK] + prompt(9, 21)
    with PrefixCache(model, ssd_config(tmp_path, snapshot_interval=2), model_id="t") as pc:
        pc.prefill(tokens, prefill_step_size=BLOCK)
        pc.flush()  # one writer batch: the quiet window held it
        runs = runs_of(pc)
        assert len(runs) == 8 and all(r is not None for r in runs)  # with or without snapshot
        headers = [read_header(payload(pc, r.file_key), r.file_key) for r in runs]
        assert any(run_layout.split_extra(n) for h in headers for n, *_ in h)
    again = ssd_config(tmp_path, snapshot_interval=2, background_quiet_ms=0)
    with PrefixCache(model, again, model_id="t") as pc:
        (cache, num), (earlier, before) = pc.fetch(asked), pc.fetch(asked[: 4 * BLOCK + 1])
        assert pc.stats()["ssd_block_hits"] >= 6 and pc.stats()["hot"]["num_blocks"] == 0
    assert num == 6 * BLOCK and before == 4 * BLOCK
    live = make_prompt_cache(model)
    prefill(model, asked[:num], live, step=BLOCK)
    want = grow(model, live, asked[num:], 4, step=BLOCK)
    got = grow(model, cache, asked[num:], 4, step=BLOCK)
    assert [max_diff(g, w) for g, w in zip(got, want, strict=True)] == [0.0] * 5
    # the control: the first layer's cache (state or K/V) of an earlier block: other logits
    wrong = make_prompt_cache(model)
    prefill(model, asked[:num], wrong, step=BLOCK)
    wrong[0] = earlier[0]
    assert max_diff(grow(model, wrong, asked[num:], 0, step=BLOCK)[0], want[0]) > 0.0
