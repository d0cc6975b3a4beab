"""Batched decode on shared prefixes through mlx-lm's BatchGenerator: the batch keeps
one copy of each prefix, gives the unshared batch's tokens and log-probabilities, and
hands each sequence back (extract) with its prefix still shared."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import prefill, prompt, tiny_model
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.shared import SharedBatchKVCache, SharedKVCache

BLOCK = 16
TOL = 1e-4
STEPS = 8


def make_pc(model) -> PrefixCache:
    return PrefixCache(model, CacheConfig(block_size=BLOCK, hot_cache_only=True), model_id="t")


def stored(pc, model, tokens) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    pc.store(tokens, cache)


def generate(model, items, *, late=(), watch=None) -> tuple[list, list[mx.array], list]:
    """Greedy-decode (cache, rest of prompt) items together (``late`` ones join after
    two steps): tokens, log-probs per sequence, and the finished sequences' caches.
    ``watch(batch caches)`` sees the generation batch's caches after every step."""
    gen = BatchGenerator(model, max_tokens=STEPS, prefill_step_size=BLOCK)
    uids = gen.insert([rest for _, rest in items], caches=[cache for cache, _ in items])
    tokens, logprobs, finished = {}, {}, {}
    step, total = 0, len(items) + len(late)
    while len(finished) < total and step < 4 * STEPS:
        if step == 2 and late:
            uids += gen.insert([rest for _, rest in late], caches=[cache for cache, _ in late])
        for r in gen.next_generated():
            tokens.setdefault(r.uid, []).append(r.token)
            logprobs.setdefault(r.uid, []).append(r.logprobs)
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
        if watch is not None and gen._generation_batch.prompt_cache:
            watch(gen._generation_batch.prompt_cache)
        step += 1
    gen.close()
    return (
        [tokens[u] for u in uids],
        [mx.stack(logprobs[u]) for u in uids],
        [finished[u] for u in uids],
    )


def worst(a: list[mx.array], b: list[mx.array]) -> float:
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
def test_batched_decode_equals_unshared_batch(arch):
    model = tiny_model(arch)
    system = prompt(1, 4 * BLOCK)
    users = [system + prompt(10 + i, 3 + 9 * i) for i in range(3)]  # padded to each other
    seen = []

    def watch(caches):
        seen.extend(c for c in caches if isinstance(c, SharedBatchKVCache))

    with make_pc(model) as pc:
        stored(pc, model, system)
        shared = [pc.fetch(u, shared=True) for u in users]
        prefix = shared[0][0][-1].lease.prefix  # the SharedPrefix
        got = generate(
            model, [(c, u[n:]) for u, (c, n) in zip(users, shared, strict=True)], watch=watch
        )
        plain = [pc.fetch(u) for u in users]
        want = generate(model, [(c, u[n:]) for u, (c, n) in zip(users, plain, strict=True)])
    assert got[0] == want[0]
    assert worst(got[1], want[1]) <= TOL
    # the batch held one copy: every row on the prefix object, attention through the hook
    assert seen and all(row[0] in prefix.layers for batch in seen for row in batch.rows)
    assert all(b.num_attends > 0 and b.num_dense == 0 for b in seen)
    # each finished sequence comes back as a single shared cache on the same prefix
    for cache, plain_cache in zip(got[2], want[2], strict=True):
        layer = cache[-1]
        assert isinstance(layer, SharedKVCache) and layer.prefix is prefix.layers[-1]
        assert layer.offset == plain_cache[-1].offset


def test_batch_of_two_prefixes_a_miss_and_a_late_arrival():
    model = tiny_model("llama")
    sys_a, sys_b = prompt(2, 3 * BLOCK), prompt(3, 2 * BLOCK)
    users = [sys_a + prompt(20, 5), sys_b + prompt(21, 9), prompt(22, 12), sys_a + prompt(23, 7)]
    with make_pc(model) as pc:
        stored(pc, model, sys_a)
        stored(pc, model, sys_b)

        def items(shared: bool, chosen: list[list[int]]) -> list:
            out = []
            for user in chosen:
                cache, n = pc.fetch(user, shared=shared)
                out.append((cache, user[n:]))
            return out

        first = items(True, users[:3])
        late = items(True, users[3:])  # joins the running batch (extend)
        assert first[2][0][0].prefix is None  # the miss: same cache types, no prefix
        assert late[0][0][0].prefix is first[0][0][0].prefix
        got = generate(model, first, late=late)
        want = generate(model, items(False, users[:3]), late=items(False, users[3:]))
        assert got[0] == want[0]
        assert worst(got[1], want[1]) <= TOL
        # negative control: a sequence on the wrong prefix is caught
        wrong_cache, _ = pc.fetch(sys_b + prompt(20, 5), shared=True)
        wrong = generate(model, [(wrong_cache, users[0][len(sys_a) :])])
        assert worst(wrong[1], want[1][:1]) > 100 * TOL
        # a finished sequence is stored like any cache, its prefix part included
        full = users[1] + got[0][1]  # the cache holds every generated token
        assert pc.store(full, got[2][1]) >= 1
        restored, m = pc.fetch([*full, 1])
        assert m == len(full)
        layer, keys = got[2][1][0], restored[0].keys
        assert mx.array_equal(
            keys[..., : layer.end, :], layer.prefix.keys[..., : layer.end, :]
        ).item()
        rest = layer.suffix.keys[..., : m - layer.end, :]
        assert mx.array_equal(keys[..., layer.end : m, :], rest).item()


def test_window_rows_past_their_prefix_batch_with_others():
    """A gemma3 sequence whose window layers already dropped the prefix (a long
    suffix) decodes in one batch with a fresh one on the same prefix."""
    model = tiny_model("gemma3_text")  # window 16
    system = prompt(4, 4 * BLOCK)
    long, short = system + prompt(30, 290), system + prompt(31, 6)
    with make_pc(model) as pc:
        stored(pc, model, system)

        def items(shared: bool) -> list:
            first, n = pc.fetch(long, shared=shared)
            prefill(model, long[n:-1], first, step=BLOCK)  # all but the last token
            second, m = pc.fetch(short, shared=shared)
            return [(first, long[-1:]), (second, short[m:])]

        shared = items(True)
        assert shared[0][0][0].prefix is None and shared[0][0][0].end > len(system)
        got = generate(model, shared)
        want = generate(model, items(False))
    assert got[0] == want[0]
    assert worst(got[1], want[1]) <= TOL


# (272, 261): the first dead step falls in the last, right-padded prompt chunk, where
# dropping columns would lose the shorter row's window (finalize moves the padding)
@pytest.mark.parametrize("lengths", [(290, 301), (272, 261)])
def test_a_batch_of_window_layers_stays_bounded(lengths):
    """Long suffixes of different lengths (right-padded prompt chunks) prefilled and
    decoded in one batch: the window layers' suffix columns stay within the window
    plus a step, and the tokens are the unshared batch's."""
    model = tiny_model("gemma3_text")  # window 16
    system = prompt(5, 4 * BLOCK)
    users = [system + prompt(40 + i, n) for i, n in enumerate(lengths)]
    widths = []

    def watch(caches):
        widths.extend(c.suffix._idx for c in caches[::2])  # the window layers

    with make_pc(model) as pc:
        stored(pc, model, system)
        items = []
        for shared in (True, False):
            fetched = [pc.fetch(u, shared=shared) for u in users]
            items.append([(c, u[n:]) for u, (c, n) in zip(users, fetched, strict=True)])
        got = generate(model, items[0], watch=watch)
        want = generate(model, items[1])
    assert got[0] == want[0]
    assert worst(got[1], want[1]) <= TOL
    assert widths and max(widths) < 16 + 256
