"""The remote tier under sustained traffic: what a lookup costs the server does not
grow with what the server holds.

A shared system prompt's last block gets a child under every user turn that
follows it. Its listing is read only near the prompt being looked up (a
sorted set in token order, listing.py): the GETs of one fetch stay within a
bound that does not depend on how many prompts were stored, and the child
that shares the most with the prompt is still found, also with a secret. A
listing keeps about ``LISTING_MAX`` members, however many children came and
went, and one under that bound loses none.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import live_logits, max_diff, prefill
from ssd_child import ROOT, block_key, make_block

from prefixcache import CacheConfig, PrefixCache
from prefixcache.blocks import Block
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.remote.listing import NEAREST

BLOCK = 16
SYSTEM = [(7 * i + 3) % 512 for i in range(2 * BLOCK)]  # 2 blocks every prompt starts with


def cache_for(tmp_path, name: str, url: str, model, **changes) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK, ssd_dir=str(tmp_path / name), ssd_min_free_bytes=0, remote_url=url
    )
    return PrefixCache(model, config.replace(**changes), model_id="tiny")


def serve(pc: PrefixCache, model, tokens: list[int]) -> tuple[int, mx.array]:
    """Fetch, prefill the rest, store: (tokens restored, logits)."""
    cache, n = pc.fetch(tokens)
    logits = prefill(model, tokens[n:], cache, step=BLOCK)
    pc.store(tokens, cache)
    return n, logits


def gets(server) -> int:
    return server.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)


@pytest.mark.parametrize("secret", [None, "a shared secret of the hosts"])
def test_a_fetch_reads_a_bounded_part_of_a_growing_listing(tmp_path, llama, redis_server, secret):
    rng = random.Random(5)
    turns = [[rng.randrange(512) for _ in range(20)] for _ in range(150)]  # a block + a tail
    writer = cache_for(tmp_path, "a", redis_server.url, llama, remote_secret=secret)
    for turn in turns:
        serve(writer, llama, SYSTEM + turn)
    writer.close()  # every block on the server
    reader = cache_for(tmp_path, "b", redis_server.url, llama, remote_secret=secret)
    client = redis_server.client()
    listings = [client.zrange(k, 0, -1) for k in client.keys("*:l")]
    # every user turn under one block: a listing under its bound loses no member
    assert max(len(members) for members in listings) == 150
    ids = np.array(turns[77][:4], "<u4").tobytes()  # no token ids on the server
    assert not any(ids in m for members in listings for m in members)
    # another host's prompt: the system prompt, then 10 of turn 77's first tokens
    tokens = SYSTEM + turns[77][:10] + [1, 2, 3]
    before = gets(redis_server)
    n, logits = serve(reader, llama, tokens)
    used = gets(redis_server) - before
    # the chain's metas (3 asked), the nearest children's metas at the stop level and
    # at the root: never the 150 children
    assert used <= 3 + 2 * 2 * NEAREST, used
    assert n == 2 * BLOCK + 10  # turn 77's block, cut after the 10 tokens it shares
    assert reader.stats()["remote_block_hits"] == 3
    assert max_diff(logits, live_logits(llama, tokens, n)) == 0.0
    other = list(tokens)
    other[5] = (other[5] + 1) % 512  # negative control: another prefix, other logits
    assert max_diff(logits, live_logits(llama, other, n)) > 0
    reader.close()


def children_under(parent: bytes, num: int, seed: int) -> list[Block]:
    """``num`` blocks of random tokens under ``parent`` (one block's arrays)."""
    arrays = make_block(seed, 1).arrays
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 512, 16, "<u4").tobytes() for _ in range(num)]
    keys = [block_key(seed, i + 2) for i in range(num)]
    return [Block.make(k, parent, ROOT, 1, t, arrays) for k, t in zip(keys, tokens, strict=True)]


def test_a_listing_stays_near_its_bound(redis_server):
    client = redis_server.client()
    bounded = RemoteTier(CacheConfig(remote_url=redis_server.url))
    bounded.writes.listing_max = 32
    for block in children_under(block_key(80, 0), 640, 80):
        assert bounded.put(block)
    bounded.flush()
    size = client.zcard(bounded.names.children(block_key(80, 0)))
    assert 8 <= size <= 96, size  # about 32: each new member thins a 32nd of the order space
    bounded.close()
    plain = RemoteTier(CacheConfig(remote_url=redis_server.url))  # the default, 16,384
    for block in children_under(block_key(81, 0), 640, 81):
        assert plain.put(block)
    plain.flush()
    # under its bound a listing loses no member (thinning every add, as a listing
    # over its bound is, would take about 640 * 640 / 16,384 / 2 = 12 of them)
    assert client.zcard(plain.names.children(block_key(81, 0))) == 640
    plain.close()
