"""The restore's ``place``: which layer uses which blocks, and its answers to readers.

A hybrid model's layers use different blocks of one chain: its attention layers
every block, its recurrent layers only the block whose state they restore. The
placer's table of the blocks each layer uses is made in one pass over the
restore's ``users`` (chain index -> layers); it must equal the definition for every
layer, and a reader asking for a layer's tensor of blocks that layer does not use
gets ``UNNEEDED`` (the reader skips it), of blocks it uses only partly None.
"""

from __future__ import annotations

import mlx.core as mx
from conftest import tiny_model
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from prefixcache.codecs import codec_for
from prefixcache.codecs.placing import _blocks_of_layers, placer
from prefixcache.memory.host import UNNEEDED

BLOCK = 8
NUM_BLOCKS = 6


def hybrid_users(cache) -> dict[int, list[int]]:
    """users as the restore makes them: attention layers every block, recurrent
    layers the last one."""
    users: dict[int, list[int]] = {}
    for layer, c in enumerate(cache):
        blocks = [NUM_BLOCKS - 1] if type(c) is ArraysCache else range(NUM_BLOCKS)
        for index in blocks:
            users.setdefault(index, []).append(layer)
    return users


def test_the_blocks_of_each_layer_are_those_whose_users_name_it():
    cache = make_prompt_cache(tiny_model("qwen3_next"))
    users = hybrid_users(cache)
    users[2] = [*users[2], 99]  # a layer of one middle block only
    table = _blocks_of_layers(users)
    layers = {layer for using in users.values() for layer in using}
    want = {layer: {i for i, using in users.items() if layer in using} for layer in layers}
    assert table == want
    state = next(i for i, c in enumerate(cache) if type(c) is ArraysCache)
    assert table[state] == {NUM_BLOCKS - 1}
    assert table[99] == {2}
    # the control: the table of a map that leaves a layer out differs
    users[NUM_BLOCKS - 1] = [x for x in users[NUM_BLOCKS - 1] if x != state]
    assert _blocks_of_layers(users).get(state) != table[state]


def test_a_reader_gets_unneeded_for_blocks_a_layer_does_not_use():
    model = tiny_model("qwen3_next")
    fresh = make_prompt_cache(model)
    tokens = NUM_BLOCKS * BLOCK
    builders = [codec_for(c).builder(c, tokens, tokens, BLOCK) for c in fresh]
    place = placer(builders, hybrid_users(fresh))
    state = next(i for i, c in enumerate(fresh) if type(c) is ArraysCache)
    attention = next(i for i, c in enumerate(fresh) if type(c) is not ArraysCache)
    shape = (1, 2, BLOCK, 4)
    # a recurrent layer's snapshot of an earlier block, or a run of blocks before its
    # own: no layer reads it
    assert place(0, f"{state}.1", mx.float32, shape) is UNNEEDED
    assert place(1, f"{state}.1", mx.float32, shape, 3) is UNNEEDED
    # a run that reaches its block uses part of it: no place, not UNNEEDED
    assert place(NUM_BLOCKS - 2, f"{state}.1", mx.float32, shape, 2) is None
    # an attention layer uses every block: no buffer made yet, so no place either
    assert place(0, f"{attention}.keys", mx.bfloat16, shape) is None
    assert place(0, f"{attention}.keys", mx.bfloat16, shape, NUM_BLOCKS) is None
