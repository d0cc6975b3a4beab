"""fetch(tokens, shared=True): one copy of a prefix for many sequences, the unshared
run's tokens and logits (max |diff| <= 1e-4 in float32), counted fallbacks, and a
prefix freed by the last sequence to let go."""

from __future__ import annotations

import gc
import threading
import weakref

import mlx.core as mx
import pytest
from conftest import QUANT_LLAMA, max_diff, prefill, prompt, tiny_model
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.shared import SharedKVCache, hook, release
from prefixcache.tiny.models import build_model

BLOCK = 16
TOL = 1e-4
# qwen3_next's and llama4's MoE run in float32 only on CPU; lfm2's convolutions and
# llama4's chunked layers stay private
FAMILIES = ["llama", "qwen3", "gemma3_text", "qwen3_next", "lfm2", "llama4"]


def make_pc(model, **cfg) -> PrefixCache:
    return PrefixCache(
        model, CacheConfig(block_size=BLOCK, hot_cache_only=True, **cfg), model_id="t"
    )


def stored(pc, model, tokens, kv=None) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK, kv=kv)
    pc.store(tokens, cache)


def run(model, cache, tokens, steps: int = 6) -> tuple[list[int], list[mx.array]]:
    """Prefill ``tokens`` (in chunks), then greedy-decode: (tokens, every step's logits)."""
    logits = [prefill(model, tokens, cache, step=BLOCK)]
    out = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits[-1]).item()))
        logits.append(model(mx.array([[out[-1]]]), cache=cache)[:, -1])
        mx.eval(logits[-1])
    return out, logits


def worst(a: list[mx.array], b: list[mx.array]) -> float:
    return max(max_diff(x, y) for x, y in zip(a, b, strict=True))


def stored_users(pc, model):
    """A stored system prompt and three sequences on it (suffixes of 1-2 chunks)."""
    system = prompt(1, 4 * BLOCK)
    stored(pc, model, system)
    return len(system), [system + prompt(10 + i, 5 + 11 * i) for i in range(3)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_shared_equals_unshared_run(arch):
    model = tiny_model(arch)
    with make_pc(model) as pc:
        num_system, users = stored_users(pc, model)
        runs = [pc.fetch(user, shared=True) for user in users]
        assert all(n == num_system for _, n in runs)
        first = runs[0][0]
        # one copy: every sequence's layers hold the same prefix objects
        layers = [i for i, c in enumerate(first) if isinstance(c, SharedKVCache)]
        assert layers and all(c[i].prefix is first[i].prefix for c, _ in runs for i in layers)
        stats = pc.stats()["shared"]
        assert (stats["num_loads"], stats["num_reuses"], stats["num_sequences"]) == (1, 2, 3)
        for user, (cache, n) in zip(users, runs, strict=True):
            got_tokens, got = run(model, cache, user[n:])
            plain, m = pc.fetch(user)
            want_tokens, want = run(model, plain, user[m:])
            assert got_tokens == want_tokens
            assert worst(got, want) <= TOL
            # negative control: another prefix under the same suffix is caught
            other = make_prompt_cache(model)
            prefill(model, prompt(99, n), other, step=BLOCK)
            assert worst(run(model, other, user[n:])[1], want) > 100 * TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_bfloat16_as_close_to_float32_as_unshared(arch):
    """In bf16 neither the split nor mlx-lm's attention is exact: the shared run must
    be as close to a float32 run of the same weights as the unshared run is."""
    model = tiny_model(arch, dtype=mx.bfloat16)
    wide = build_model(arch, dtype=mx.bfloat16)
    wide.set_dtype(mx.float32)  # the same (bf16-rounded) weights, computed in float32
    with make_pc(model) as pc:
        _, users = stored_users(pc, model)
        for user in users:
            cache, n = pc.fetch(user, shared=True)
            plain, _ = pc.fetch(user)
            truth = make_prompt_cache(wide)
            prefill(wide, user[:n], truth, step=BLOCK)
            want = prefill(wide, user[n:], truth, step=BLOCK)
            shared_err = max_diff(prefill(model, user[n:], cache, step=BLOCK), want)
            unshared_err = max_diff(prefill(model, user[n:], plain, step=BLOCK), want)
            assert shared_err <= 1.5 * unshared_err + 0.02, (shared_err, unshared_err)
            assert shared_err > 1e-3  # negative control: bf16 is not float32 here


def test_a_prompt_diverging_inside_the_prefix_shares_only_the_common_part():
    model = tiny_model("llama")
    system = prompt(2, 4 * BLOCK)
    with make_pc(model) as pc:
        stored(pc, model, system)
        first, _ = pc.fetch(system + prompt(20, 5), shared=True)
        late = system[:37] + prompt(21, 30)  # diverges at token 37
        cache, n = pc.fetch(late, shared=True)
        assert n == 37  # a view of the live prefix's head, not the stored blocks past it
        assert cache[0].prefix is first[0].prefix and cache[0].num_visible == 37
        got = run(model, cache, late[n:])[1]
        live = make_prompt_cache(model)
        prefill(model, late[:n], live, step=BLOCK)
        assert worst(got, run(model, live, late[n:])[1]) <= TOL


def test_tokens_past_the_live_prefix_are_restored_privately():
    model = tiny_model("llama")
    system = prompt(3, 2 * BLOCK)
    history = system + prompt(30, 3 * BLOCK)  # a conversation stored on the system prompt
    with make_pc(model) as pc:
        stored(pc, model, system)
        live, _ = pc.fetch(system + prompt(31, 4), shared=True)
        stored(pc, model, history)
        turn = history + prompt(32, 9)
        cache, n = pc.fetch(turn, shared=True)
        assert n == len(history)
        assert cache[0].prefix is live[0].prefix and cache[0].end == len(system)
        assert cache[0].suffix.offset == len(history) - len(system)  # the gap, copied
        assert pc.stats()["shared"]["num_gap_restores"] == 1
        plain, m = pc.fetch(turn)
        assert worst(run(model, cache, turn[n:])[1], run(model, plain, turn[m:])[1]) <= TOL


@pytest.mark.parametrize("start", [0, 40])
def test_quantized_kv(start):
    model = tiny_model("llama", **QUANT_LLAMA)
    kv = (8, 32, start)
    system = prompt(4, 4 * BLOCK)
    user = system + prompt(40, 12)
    with make_pc(model, kv_bits=8, kv_group_size=32, quantized_kv_start=start) as pc:
        if start:
            stored(pc, model, system[: 2 * BLOCK], kv=kv)  # blocks 0-1 at full precision
        stored(pc, model, system, kv=kv)
        cache, n = pc.fetch(user, shared=True)
        assert n == len(system)
        plain, _ = pc.fetch(user)
        assert all(isinstance(c, QuantizedKVCache) for c in plain)
        assert all(c.prefix.keys[0].dtype == mx.uint32 for c in cache)  # packed, shared
        got = prefill(model, user[n:], cache, step=BLOCK, kv=kv)
        assert max_diff(got, prefill(model, user[n:], plain, step=BLOCK, kv=kv)) <= TOL
        # a cache mlx-lm quantizes only later cannot be shared (it is not re-packed in
        # place): below the start, a private copy, counted
        early = system[:20] + prompt(41, 30)
        second, m = pc.fetch(early, shared=True)
        assert 0 < m == pc.match(early) < 40
        fallbacks = pc.stats()["shared"].get("num_fallbacks_kv_quant_pending", 0)
        if start:
            assert type(second[0]) is KVCache and fallbacks == 1
        else:
            assert second[0].prefix is cache[0].prefix and fallbacks == 0
        plain, _ = pc.fetch(early)
        got = prefill(model, early[m:], second, step=BLOCK, kv=kv)
        assert max_diff(got, prefill(model, early[m:], plain, step=BLOCK, kv=kv)) <= TOL


def test_uncovered_model_falls_back_to_a_private_copy_counted():
    model = tiny_model("gemma2")  # computes its own attention: the hook never sees it
    system = prompt(5, 3 * BLOCK)
    user = system + prompt(50, 7)
    with make_pc(model) as pc:
        stored(pc, model, system)
        cache, n = pc.fetch(user, shared=True)
        assert n == len(system) and all(type(c) is KVCache for c in cache)
        stats = pc.stats()["shared"]
        assert stats["num_fallbacks"] == stats["num_fallbacks_attention_not_hooked"] == 1
        assert stats["num_prefixes"] == 0
        plain, _ = pc.fetch(user)
        assert max_diff(prefill(model, user[n:], cache), prefill(model, user[n:], plain)) == 0.0
    assert not hook.installed()  # the probe took its hook off


@pytest.mark.parametrize("arch", ["mamba2", "falcon_h1"])
def test_a_model_without_a_shared_layer_falls_back_counted(arch):
    model = tiny_model(arch)  # recurrent only; CacheList(mamba, attention) layers
    system = prompt(11, 2 * BLOCK)
    with make_pc(model) as pc:
        stored(pc, model, system)
        cache, n = pc.fetch(system + prompt(110, 5), shared=True)
        assert n == len(system) and not any(isinstance(c, SharedKVCache) for c in cache)
        stats = pc.stats()["shared"]
        assert stats["num_fallbacks"] == stats["num_fallbacks_no_shared_layer"] == 1


def test_the_last_sequence_to_let_go_frees_the_prefix():
    model = tiny_model("llama")
    system = prompt(6, 8 * BLOCK)
    with make_pc(model) as pc:
        stored(pc, model, system)
        gc.collect()
        base = mx.get_active_memory()
        seqs = [pc.fetch(system + prompt(60 + i, 3), shared=True)[0] for i in range(3)]
        prefix = weakref.ref(seqs[0][0].lease.prefix)
        nbytes = prefix().nbytes
        held = mx.get_active_memory() - base
        assert nbytes <= held < 1.5 * nbytes  # once, not three times
        assert hook.installed() and pc.shared_prefixes.stats()["num_sequences"] == 3
        release(seqs.pop())
        del seqs[0]
        gc.collect()
        assert prefix() is not None and prefix().num_users == 1
        seqs.clear()
        gc.collect()
        assert prefix() is None  # freed with the last sequence
        assert mx.get_active_memory() - base < nbytes / 4
        assert pc.stats()["shared"]["num_prefixes"] == 0
        assert not hook.installed()
        # the next sequence on it loads it again
        pc.fetch(system + prompt(70, 3), shared=True)
        assert pc.stats()["shared"]["num_loads"] == 2


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_store_of_a_shared_cache_keeps_its_suffix(arch):
    model = tiny_model(arch)
    system = prompt(7, 3 * BLOCK)
    user = system + prompt(80, 2 * BLOCK + 5)
    with make_pc(model) as pc:
        stored(pc, model, system)
        cache, n = pc.fetch(user, shared=True)
        prefill(model, user[n:], cache, step=BLOCK)
        assert pc.store(user, cache) == 2  # the suffix's two new blocks
        longer = user + prompt(81, 6)
        restored, m = pc.fetch(longer)
        assert m == len(user)
        got = prefill(model, longer[m:], restored, step=BLOCK)
        want = prefill(model, longer[m:], cache, step=BLOCK)
        assert max_diff(got, want) <= TOL


def test_window_layers_forget_what_no_query_sees():
    """A sliding-window layer's suffix stays bounded by the window (plus one step), as
    mlx-lm's ring is, while full-attention layers keep the shared prefix."""
    model = tiny_model("gemma3_text")  # window 16, global layers 1 and 3
    system = prompt(8, 4 * BLOCK)
    user = system + prompt(90, 300)
    with make_pc(model) as pc:
        stored(pc, model, system)
        cache, n = pc.fetch(user, shared=True)
        got = run(model, cache, user[n:], steps=4)
        plain, _ = pc.fetch(user)
        want = run(model, plain, user[n:], steps=4)
    assert got[0] == want[0] and worst(got[1], want[1]) <= TOL
    window, full = cache[0], cache[1]
    assert window.prefix is None and window.suffix.offset < 16 + window.suffix.step
    assert window.offset == full.offset == len(user) + 4
    assert full.prefix is not None and full.suffix.offset == len(user) - n + 4


def test_threads_share_one_prefix_while_stats_are_read():
    """Real threads fetch shared caches on one prefix and decode while another reads
    the stats (the facade's lock and the registry's are never taken in both orders)."""
    model = tiny_model("llama")
    system = prompt(9, 4 * BLOCK)
    users = [system + prompt(100 + i, 7 + 3 * i) for i in range(4)]
    with make_pc(model) as pc:
        stored(pc, model, system)
        want = [run(model, *_rest(pc.fetch(u), u)) for u in users]
        got: dict[int, tuple] = {}
        errors: list[BaseException] = []
        done = threading.Event()
        start = threading.Barrier(len(users) + 1)

        def user(i: int) -> None:
            try:
                start.wait()
                cache, n = pc.fetch(users[i], shared=True)
                got[i] = (*run(model, cache, users[i][n:]), cache)
            except BaseException as err:  # re-raised below
                errors.append(err)

        def reader() -> None:
            start.wait()
            while not done.is_set():
                pc.stats()

        threads = [threading.Thread(target=user, args=(i,)) for i in range(len(users))]
        watcher = threading.Thread(target=reader)
        for t in [*threads, watcher]:
            t.start()
        for t in threads:
            t.join(timeout=120)
        done.set()
        watcher.join(timeout=120)
        assert not errors, errors
        assert not any(t.is_alive() for t in [*threads, watcher])
        for i in range(len(users)):
            assert got[i][0] == want[i][0] and worst(got[i][1], want[i][1]) <= TOL
        stats = pc.stats()["shared"]
        assert stats["num_fetches"] == len(users) and stats["num_prefixes"] == 1
        assert stats["num_loads"] + stats["num_reuses"] == len(users)


def _rest(fetched, user):
    cache, n = fetched
    return cache, user[n:]
