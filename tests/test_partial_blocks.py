"""Partial-block reuse: tails of stored sequences, prompts diverging inside a stored block.

Every case compares the logits of a restored cache with a live run chunked
alike (bit-exact on CPU) and has a negative control: the same restore from
another sequence's block gives other logits. Recurrent state cannot be cut
back: it is restored only where a stored sequence (or a snapshot) ends.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
# (arch, model overrides, kv quantization (bits, group size, start) or None)
TRIMMABLE = {
    "kv": ("llama", {}, None),
    "quantized": ("llama", QUANT_LLAMA, (4, 32, 0)),
    "rotating": ("gemma3_text", {}, None),
    "chunked": ("llama4", {}, None),
}
WINDOWED = ("rotating",)  # its 16-token window: K/V kept only around restore points


def make_pc(model, kv) -> PrefixCache:
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    return PrefixCache(
        model, CacheConfig(block_size=BLOCK, hot_cache_only=True, **quant), model_id="tiny"
    )


def finished(model, tokens, kv=None) -> list:
    """A cache prefilled live in 16-token chunks, as a scheduler hands it to ``store``."""
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, kv=kv)
    return cache


def continued(model, cache, tokens, kv=None) -> mx.array:
    return prefill(model, tokens, cache, kv=kv)


def reference(model, tokens, split: int, *cuts: int, kv=None) -> mx.array:
    """Logits of ``tokens`` live, chunked as the restored run is: up to ``split``,
    then to each of ``cuts`` (checkpoints the stored prefill ended chunks at), then on."""
    cache = finished(model, tokens[:split], kv)
    for start, end in zip((split, *cuts), cuts, strict=False):
        continued(model, cache, tokens[start:end], kv)
    return continued(model, cache, tokens[(split, *cuts)[-1] :], kv)


@pytest.mark.parametrize("case", list(TRIMMABLE))
def test_tail_of_a_stored_sequence_is_reused(case):
    arch, overrides, kv = TRIMMABLE[case]
    model = tiny_model(arch, **overrides)
    a = prompt(1, 45)  # 2 full blocks and a 13-token tail
    other = a[:32] + prompt(2, 13)  # same full blocks, another tail
    probe = a + prompt(3, 7)
    with make_pc(model, kv) as pc:
        pc.store(a, finished(model, a, kv))
        pc.store(other, finished(model, other, kv))
        assert pc.match(probe) == 45
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 45
        want = reference(model, probe, 45, kv=kv)
        assert max_diff(continued(model, cache, probe[45:], kv), want) == 0.0
        # negative control: the other tail's cache, continued with the same tokens
        theirs, num_theirs = pc.fetch([*other, 1])
        assert num_theirs == 45
        assert max_diff(continued(model, theirs, probe[45:], kv), want) > 0.0


@pytest.mark.parametrize("case", list(TRIMMABLE))
@pytest.mark.parametrize("where", ["block", "tail"])
def test_prompt_diverging_inside_a_stored_block_is_cut_back(case, where):
    arch, overrides, kv = TRIMMABLE[case]
    model = tiny_model(arch, **overrides)
    a = prompt(1, 64 if where == "block" else 45)  # block 2 is [32, 48); a tail starts at 32
    other = a[:32] + prompt(2, 16)
    probe = a[:40] + prompt(3, 10)  # diverges at token 40: inside block 2 / the tail
    with make_pc(model, kv) as pc:
        if where == "block":
            pc.prefill(a, prefill_step_size=BLOCK)
            pc.prefill(other, prefill_step_size=BLOCK)
        else:
            pc.store(a, finished(model, a, kv))
            pc.store(other, finished(model, other, kv))
        cuts = [40]
        if where == "block" and case in WINDOWED:
            # a's block 2 was cut after the window left its first tokens: the deepest
            # covered point is 32; the probe's prefill keeps the state at 40 (junction)
            assert pc.fetch(probe)[1] == 32
            cuts = [32, *pc.checkpoints(probe, 32)]
            assert cuts == [32, 39, 40]  # 39: the probe's end minus checkpoint_tail
            pc.prefill(probe, prefill_step_size=BLOCK)
            probe = a[:40] + prompt(4, 10)
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 40
        want = reference(model, probe, *cuts, kv=kv)
        assert max_diff(continued(model, cache, probe[40:], kv), want) == 0.0
        # negative control: cut back from the other sequence's block (its tokens 32..40)
        theirs, num_theirs = pc.fetch(other[:40] + probe[40:])
        assert num_theirs == 40
        assert max_diff(continued(model, theirs, probe[40:], kv), want) > 0.0


def test_fully_cached_prompt_inside_a_block_leaves_one_token():
    model = tiny_model("llama")
    a = prompt(1, 64)
    with make_pc(model, None) as pc:
        pc.store(a, finished(model, a))
        probe = a[:37]  # ends inside block 2
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 36
        want = reference(model, probe, 36)
        assert max_diff(continued(model, cache, probe[36:]), want) == 0.0


def test_superseded_tails_are_dropped():
    """A longer stored sequence cut back gives the shorter one's tail: it is let go."""
    model = tiny_model("llama")
    a = prompt(1, 40)
    longer = a + prompt(2, 4)
    with make_pc(model, None) as pc:
        pc.store(a, finished(model, a))
        nbytes = pc.hot.nbytes
        pc.store(longer, finished(model, longer))
        tails = [b for b in pc.hot if b.index == 2]
        assert [b.num_tokens for b in tails] == [12]
        assert pc.hot.nbytes - nbytes == tails[0].nbytes // 12 * 4
        assert pc.match([*a, 9]) == 40


HYBRIDS = ["qwen3_next", "falcon_h1", "mamba2"]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_recurrent_model_hits_through_plain_store(arch):
    """A scheduler's own prefill loop, then ``store``: the next turn resumes at its end."""
    model = tiny_model(arch)
    a = prompt(1, 45)
    other = a[:32] + prompt(2, 13)
    probe = a + prompt(3, 3)
    with make_pc(model, None) as pc:
        assert pc.store(a, finished(model, a)) == 2
        pc.store(other, finished(model, other))
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 45
        assert pc.stats()["miss_reasons"]["boundary_state_missing"] == 0
        want = reference(model, probe, 45)
        assert max_diff(continued(model, cache, probe[45:]), want) == 0.0
        # negative control: the other sequence's state at its end
        theirs, num_theirs = pc.fetch([*other, 1])
        assert num_theirs == 45
        assert max_diff(continued(model, theirs, probe[45:]), want) > 0.0
        # a block-aligned end keeps its state in the last full block
        b = prompt(4, 48)
        pc.store(b, finished(model, b))
        assert pc.fetch([*b, 1, 2])[1] == 48


@pytest.mark.parametrize("arch", HYBRIDS)
def test_recurrent_state_is_never_cut_back(arch):
    """Diverging inside a tail: the deepest snapshot at or before the divergence."""
    model = tiny_model(arch)
    a = prompt(1, 45)
    probe = a[:40] + prompt(3, 5)
    with make_pc(model, None) as pc:
        pc.store(a, finished(model, a))
        assert pc.fetch(probe)[1] == 0  # no state at 32 or 40 was kept
        assert pc.stats()["miss_reasons"]["partial_block"] == 1  # the tail shares 8
    with make_pc(model, None) as pc:
        pc.prefill(a, prefill_step_size=BLOCK)  # checkpoints: 45 - 11 = 34 (and 16, 32)
        cache, num_cached = pc.fetch(probe)
        assert num_cached == 34
        want = reference(model, probe, 34)
        assert max_diff(continued(model, cache, probe[34:]), want) == 0.0


def test_interval_snapshots_are_shed_before_any_block():
    model = tiny_model("qwen3_next")
    tokens = prompt(1, 100)  # blocks 0..5, each with a snapshot, and a 4-token tail
    # no checkpoint before the end (checkpoint_tail 0): only the interval's snapshots
    config = CacheConfig(
        block_size=BLOCK, hot_cache_only=True, snapshot_interval=1, checkpoint_tail=0
    )
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.prefill(tokens, prefill_step_size=BLOCK)
        num_blocks, nbytes = len(pc.hot), pc.hot.nbytes
        state = pc.layout.state_bytes
        assert pc.trim_hot(nbytes - 6 * state) == 0  # no block goes ...
        assert pc.stats()["hot"]["num_shed_snapshots"] == 6  # ... the 6 interval snapshots do
        assert len(pc.hot) == num_blocks and pc.hot.nbytes == nbytes - 6 * state
        cache, num_cached = pc.fetch([*tokens, 1, 2])
        assert num_cached == 100  # the state at the sequence's end stays
        want = reference(model, [*tokens, 1, 2], 100)
        assert max_diff(continued(model, cache, [1, 2]), want) == 0.0
        assert pc.fetch(tokens[:40] + prompt(2, 5))[1] == 0  # no state at 16 or 32 now
        assert pc.trim_hot(nbytes - 7 * state) == 1  # then blocks go, leaves first


def test_prefill_keeps_the_state_where_stored_sequences_branch():
    """Sparse snapshots miss a shared system prompt once; then its end state is kept."""
    model = tiny_model("qwen3_next")
    system = prompt(1, 48)  # 3 blocks; the interval (8 blocks) has no snapshot there
    users = [system + prompt(10 + i, 20) for i in range(3)]
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, snapshot_interval=8)
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.prefill(users[0])
        assert pc.stored_prefix(users[1]) == 48 and pc.match(users[1]) == 0
        _, logits = pc.prefill(users[1])  # misses, and keeps the state at 48
        assert max_diff(logits, reference(model, users[1], 48)) == 0.0
        assert pc.match(users[2]) == 48
        _, logits = pc.prefill(users[2])
        assert pc.stats()["cached_tokens"] == 48
        assert max_diff(logits, reference(model, users[2], 48)) == 0.0
        # negative control: another system prompt's state at 48 gives other logits
        other = prompt(2, 48) + users[2][48:]
        pc.prefill(prompt(2, 48) + prompt(3, 5))
        pc.prefill(prompt(2, 48) + prompt(4, 5))  # branches at 48: its state is kept
        theirs, num_theirs = pc.fetch(other)
        assert num_theirs == 48
        assert max_diff(continued(model, theirs, users[2][48:]), logits) > 0.0
