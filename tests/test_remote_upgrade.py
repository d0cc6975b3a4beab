"""Keys an older release left on the remote server (real redis-server).

Releases before the sorted children listings (``:l``) kept a parent's children
as a plain set of names (``{prefix}:{name}:c``, ``SADD``). Nothing reads those
sets now: a tail listed only there (its meta and parts are format 2, readable)
is a miss for the next turn on another host, which restores the full blocks
before it and never a wrong cache, until a host stores that tail again (then
it is listed in ``:l``). ``prefixcache gc --remote-url`` removes the old sets.
"""

from __future__ import annotations

from conftest import live_logits, max_diff, prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiers.remote.gc import plan_gc, run_gc
from prefixcache.tiers.remote.listing import member
from prefixcache.tiers.remote.names import Names

BLOCK = 16


def host(model, tmp_path, server, name: str) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK, ssd_dir=str(tmp_path / name), ssd_min_free_bytes=0, remote_url=server.url
    )
    return PrefixCache(model, config, model_id="t")


def stored(pc: PrefixCache, model, tokens: list[int]) -> None:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    pc.store(tokens, cache)
    pc.flush()


def as_an_older_release_listed_it(server, names: Names, parent: bytes, tokens, key) -> None:
    """Move the tail's member from its parent's listing to the old children set."""
    r = server.client()
    assert r.zrem(names.children(parent), member(names, parent, tokens, key)) == 1
    old = f"{names.prefix}:{{{names.name(parent).hex()}}}:c"
    r.sadd(old, names.name(key))


def next_turn_on_a_second_host(llama, tmp_path, server, turn, name: str) -> int:
    nxt = [*turn, *prompt(9, 12)]
    with host(llama, tmp_path, server, name) as two:
        cache, num = two.fetch(nxt)
        want = live_logits(llama, nxt, num, step=BLOCK)
        assert max_diff(prefill(llama, nxt[num:], cache, step=BLOCK), want) == 0.0
    return num


def test_a_tail_an_older_release_listed_is_a_miss_and_gc_removes_the_old_set(
    llama, tmp_path, redis_server
):
    turn = prompt(8, BLOCK + 5)  # a block and a 5-token tail
    with host(llama, tmp_path, redis_server, "one") as one:
        stored(one, llama, turn)
        remote = one.tiers.named("remote")
        names = remote.names
        tail = next(b for b in one.hot if b.num_tokens == 5)
    # the control: listed in :l, another host restores the tail too
    assert next_turn_on_a_second_host(llama, tmp_path, redis_server, turn, "two") == BLOCK + 5
    as_an_older_release_listed_it(redis_server, names, tail.parent, tail.tokens, tail.key)
    # listed only in the old set: the block before it, not the tail (nothing wrong)
    assert next_turn_on_a_second_host(llama, tmp_path, redis_server, turn, "three") == BLOCK
    r = redis_server.client()
    assert r.exists(names.meta(tail.key))  # the tail itself is still there
    assert len(r.keys("prefixcache:{*}:c")) == 1
    with host(llama, tmp_path, redis_server, "four") as pc:
        client = pc.tiers.named("remote").client
        plan = plan_gc(client, Names("prefixcache"), model=None, older_than=None)
        assert plan.num_selected == 0  # no block removed: only keys nothing reads
        run_gc(client, Names("prefixcache"), plan)
    assert r.keys("prefixcache:{*}:c") == []
    # stored again (any host): listed in :l, found again
    with host(llama, tmp_path, redis_server, "five") as again:
        stored(again, llama, turn)
    assert next_turn_on_a_second_host(llama, tmp_path, redis_server, turn, "six") == BLOCK + 5
