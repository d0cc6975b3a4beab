"""The checkpoint protocol: state that cannot be cut back is kept where prompts resume.

A scheduler's loop (the README's): ``fetch``, prefill to each of
``checkpoints`` and ``capture`` there, prefill the rest, ``store`` what the
cache holds. Restores are compared with a live run chunked alike (bit-exact on
CPU), each with a negative control.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, max_diff, prompt, tiny_model
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
LAYOUTS = {  # name: (arch, model overrides, kv quantization (bits, group, start))
    "kv": ("llama", {}, None),
    "quantized": ("llama", QUANT_LLAMA, (4, 32, 0)),
    "rotating": ("gemma3_text", {}, None),
    "chunked": ("llama4", {}, None),
    "qwen3_next": ("qwen3_next", {}, None),
    "lfm2": ("lfm2", {}, None),
    "mamba2": ("mamba2", {}, None),
    "falcon_h1": ("falcon_h1", {}, None),
    "deepseek_v41": ("deepseek_v41", {}, None),  # window, compressed groups, open rows
}
CUT_BACK = ("kv", "quantized")  # every token is a restore point: no checkpoint needed


def make_pc(layout: str, **settings) -> tuple[PrefixCache, object, tuple | None]:
    arch, overrides, kv = LAYOUTS[layout]
    model = tiny_model(arch, **overrides)
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, **quant, **settings)
    return PrefixCache(model, config, model_id="tiny"), model, kv


def run(model, tokens, cache, kv) -> mx.array:
    """``tokens`` through the model as one chunk (quantizing as mlx-lm does); last logits."""
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    if kv is not None:
        maybe_quantize_kv_cache(cache, kv[2], kv[1], kv[0])
    mx.eval(logits, [c.state for c in cache])
    return logits


def serve(pc: PrefixCache, model, tokens, kv, reply: int = 3) -> tuple[list[int], mx.array]:
    """The scheduler loop; returns (the checkpoints its chunks ended at, last prompt logits).

    ``reply`` stands for generated tokens: the cache then holds them but the last."""
    cache, n = pc.fetch(tokens)
    ends = []
    for stop in pc.checkpoints(tokens, n):
        run(model, tokens[n:stop], cache, kv)
        pc.capture(tokens[:stop], cache)
        ends.append(stop)
        n = stop
    logits = run(model, tokens[n:], cache, kv)
    done = tokens + prompt(99, reply)
    run(model, done[len(tokens) : -1], cache, kv)
    pc.store(done[:-1], cache)
    return ends, logits


def live(model, tokens, ends, kv) -> mx.array:
    """Last logits of ``tokens`` run cold with chunks ending at ``ends`` (then the end)."""
    cache, pos, logits = make_prompt_cache(model), 0, None
    for end in [*ends, len(tokens)]:
        logits = run(model, tokens[pos:end], cache, kv)
        pos = end
    return logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoints_are_where_state_cannot_be_cut_back(layout):
    pc, model, kv = make_pc(layout, snapshot_interval=4)
    system = prompt(1, 150)
    with pc:
        first = system + prompt(2, 40)
        if layout in CUT_BACK:
            assert pc.checkpoints(first) == []  # costs nothing there
            return
        # nothing stored: the interval's points (64, 128) and the end minus 11
        assert pc.checkpoints(first) == [64, 128, 179]
        assert pc.checkpoints(first, 100) == [128, 179]  # only past what was restored
        serve(pc, model, first, kv)
        second = system + prompt(3, 40)
        assert pc.stored_prefix(second) == 150
        assert pc.checkpoints(second) == [64, 128, 150, 179]  # the junction at 150


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_third_prompt_on_a_shared_prefix_resumes_at_the_junction(layout):
    """The second sighting of a 150-token prefix keeps the state at its end (not a
    block boundary); the third restores all 150 tokens, exactly."""
    pc, model, kv = make_pc(layout, snapshot_interval=4)
    system = prompt(1, 150)
    first, second, third = (system + prompt(s, 40) for s in (2, 3, 4))
    with pc:
        first_ends, _ = serve(pc, model, first, kv)
        second_ends, _ = serve(pc, model, second, kv)
        cache, n = pc.fetch(third)
        assert n == 150
        # the state at 150: the first prompt's chunks up to where the second resumed
        want = live(
            model, third, sorted({*(e for e in first_ends + second_ends if e < 150), 150}), kv
        )
        assert max_diff(run(model, third[150:], cache, kv), want) == 0.0
        # negative control: another prefix's state at 150, continued alike
        other = prompt(5, 150)
        serve(pc, model, other + prompt(6, 40), kv)
        serve(pc, model, other + prompt(7, 40), kv)
        theirs, m = pc.fetch(other + third[150:])
        assert m == 150
        assert max_diff(run(model, third[150:], theirs, kv), want) > 0.0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_exact_repeat_restores_all_but_the_short_tail(layout):
    pc, model, kv = make_pc(layout)
    tokens = prompt(1, 120)
    with pc:
        ends, _logits = serve(pc, model, tokens, kv)
        cache, n = pc.fetch(tokens)
        assert n >= len(tokens) - pc.config.checkpoint_tail
        before = [e for e in ends if e <= n]
        want = live(model, tokens, before if n in before else [*before, n], kv)
        assert max_diff(run(model, tokens[n:], cache, kv), want) == 0.0


@pytest.mark.parametrize("layout", ["qwen3_next", "mamba2", "rotating", "chunked"])
def test_capture_keeps_the_state_at_any_position(layout):
    """A scheduler's own 50-token chunks (not multiples of the block): each capture
    keeps the state at its exact end, so the next prompt branching there resumes."""
    pc, model, kv = make_pc(layout)
    tokens = prompt(1, 200)
    with pc:
        cache = make_prompt_cache(model)
        for end in (50, 100, 150):
            run(model, tokens[end - 50 : end], cache, kv)
            pc.capture(tokens[:end], cache)
        probe = tokens[:150] + prompt(2, 20)
        restored, n = pc.fetch(probe)
        assert n == 150
        want = live(model, probe, [50, 100, 150], kv)
        assert max_diff(run(model, probe[150:], restored, kv), want) == 0.0
        assert pc.fetch(tokens[:100] + prompt(3, 20))[1] == 100
        if layout != "mamba2":  # recurrent state alone does not say how many tokens it holds
            with pytest.raises(ValueError, match="holds 150 tokens but 149"):
                pc.capture(tokens[:149], cache)  # a position the cache does not hold


@pytest.mark.parametrize("layout", ["qwen3_next", "lfm2", "mamba2", "falcon_h1"])
def test_the_deepest_restorable_point_wins_over_the_most_shared_child(layout):
    """Under one block two children: a sequence that goes on past the prompt's own
    (sharing the most tokens, but its state cannot be cut back) and a shorter
    checkpoint tail that is a prefix of the prompt: the tail is restored."""
    pc, model, kv = make_pc(layout, checkpoint_tail=0)
    system = prompt(1, 40)  # 2 blocks and 8 tokens
    with pc:
        cache = make_prompt_cache(model)
        run(model, system, cache, kv)
        pc.capture(system, cache)  # a tail 32..40 with the state at 40
        longer = system + prompt(2, 5)
        run(model, longer[40:], cache, kv)
        pc.store(longer, cache)  # a tail 32..45: shares 8 + 2 tokens with the probe
        probe = system + longer[40:42] + prompt(3, 6)
        assert pc.stored_prefix(probe) == 42
        restored, n = pc.fetch(probe)
        assert n == 40
        want = live(model, probe, [40], kv)
        assert max_diff(run(model, probe[40:], restored, kv), want) == 0.0


def test_windows_that_have_not_wrapped_need_no_checkpoint():
    pc, _, _ = make_pc("rotating")
    with pc:
        window = min(pc.layout.window_sizes)
        assert pc.checkpoints(prompt(1, window)) == []
        assert pc.checkpoints(prompt(1, window + 20)) != []


@pytest.mark.parametrize("layout", ["qwen3_next", "chunked"])
def test_prefill_is_the_protocol(layout):
    """``PrefixCache.prefill`` runs the same loop (with mlx-lm's chunks between)."""
    pc, _model, _kv = make_pc(layout, snapshot_interval=4)
    system = prompt(1, 150)
    with pc:
        pc.prefill(system + prompt(2, 40))
        cuts = pc.checkpoints(system + prompt(3, 40))
        assert 150 in cuts
        pc.prefill(system + prompt(3, 40))
        assert pc.match(system + prompt(4, 40)) == 150
