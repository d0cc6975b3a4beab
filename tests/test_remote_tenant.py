"""A block's tenant goes remote with it: a second host that restores a block from the
remote tier and promotes it into hot and SSD charges it to the tenant that stored it
(against a real redis-server), signed or not; a block without a tenant key (the default
tenant, or written by the previous release) is charged to the default tenant."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache
from ssd_child import make_block

from prefixcache import CacheConfig, PrefixCache
from prefixcache.memory.host import tensors_of
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.remote.format import TENANT, block_meta, decode_meta, encode_parts
from prefixcache.tiers.remote.gc import plan_gc, run_gc
from prefixcache.tiers.remote.names import Names

SECRET = "a secret shared by the hosts"


def host(model, tmp_path, server, name: str, secret: str | None) -> PrefixCache:
    config = CacheConfig(
        block_size=16,
        hot_max_bytes=256 << 10,
        hot_tenant_floors="b=16K",  # tenant shares on: stores carry their tenant
        ssd_dir=str(tmp_path / name),
        ssd_min_free_bytes=0,
        remote_url=server.url,
        remote_secret=secret,
    )
    return PrefixCache(model, config, model_id="t")


def blocks_of(pc: PrefixCache, tier: str) -> dict[str, int]:
    """Blocks each tenant holds in ``tier`` (tenants holding none left out)."""
    figures = pc.stats()["tenants"]
    return {n: f[tier]["num_blocks"] for n, f in figures.items() if f[tier]["num_blocks"]}


def promoted_on_a_second_host(model, tmp_path, server, secret, *, drop_tenants=False):
    """Host one stores a 48-token prompt for each of tenants a and b (3 blocks each),
    through to the server; host two restores both and promotes them: its hot and
    SSD tenants' blocks. ``drop_tenants``: the server's tenant keys deleted first
    (what the previous release wrote)."""
    prompts = {"a": prompt(41, 48), "b": prompt(42, 48)}
    one = host(model, tmp_path, server, "one", secret)
    try:
        for tenant, tokens in prompts.items():
            cache = make_prompt_cache(model)
            prefill(model, tokens, cache)
            one.store(tokens, cache, tenant=tenant)
        one.flush()
    finally:
        one.close()
    r = server.client()
    tenant_keys = r.keys("prefixcache:{*}:t")
    assert len(tenant_keys) == 6  # one per block: both tenants are named
    if drop_tenants:
        r.delete(*tenant_keys)
    two = host(model, tmp_path, server, "two", secret)
    try:
        for tokens in prompts.values():
            _, got = two.fetch([*tokens, 7])
            assert got == 48  # all from the remote tier
        two.flush()  # the promotions done
        assert two.stats()["remote"]["num_loads"] >= 6
        return blocks_of(two, "hot"), blocks_of(two, "ssd")
    finally:
        two.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
def test_a_promoted_block_is_charged_to_its_own_tenant(llama, tmp_path, redis_server, secret):
    hot, ssd = promoted_on_a_second_host(llama, tmp_path, redis_server, secret)
    assert hot == {"a": 3, "b": 3}
    assert ssd == {"a": 3, "b": 3}


def test_without_its_tenant_key_a_promoted_block_is_charged_to_the_default(
    llama, tmp_path, redis_server
):
    # negative control, and what blocks of the previous release read as
    hot, ssd = promoted_on_a_second_host(llama, tmp_path, redis_server, None, drop_tenants=True)
    assert hot == {"": 6}
    assert ssd == {"": 6}


def test_a_default_tenant_block_writes_no_tenant_key(llama, tmp_path, redis_server):
    model = llama
    pc = host(model, tmp_path, redis_server, "one", None)
    try:
        tokens = prompt(43, 48)
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        pc.store(tokens, cache)
        pc.flush()
        r = redis_server.client()
        assert len(r.keys("prefixcache:{*}:m")) == 3
        assert r.keys("prefixcache:{*}:t") == []
    finally:
        pc.close()


def test_a_tenant_changes_one_flag_bit_of_the_meta_that_the_previous_release_ignores():
    block = make_block(44, 0)
    tensors = tensors_of(dict(block.arrays))
    _, digests = encode_parts(block.key, tensors, Names("p"))
    plain = block_meta(block, tensors, digests, Names("p"))
    owned = block_meta(dataclasses.replace(block, tenant="a"), tensors, digests, Names("p"))
    flags = 5  # magic (4 bytes), format, flags: the previous release tests SIGNED only
    assert owned[flags] == plain[flags] | TENANT and owned[flags] != plain[flags]
    assert owned[:flags] + owned[flags + 1 : -8] == plain[:flags] + plain[flags + 1 : -8]
    assert decode_meta(block.key, owned, Names("p")).has_tenant
    assert not decode_meta(block.key, plain, Names("p")).has_tenant


def test_remove_and_gc_delete_tenant_keys(redis_server):
    tier = RemoteTier(CacheConfig(remote_url=redis_server.url))
    try:
        blocks = [dataclasses.replace(make_block(45, i), tenant="a") for i in range(3)]
        for block in blocks:
            assert tier.put(block)
        tier.flush()
        r = redis_server.client()
        assert len(r.keys("prefixcache:{*}:t")) == 3
        assert tier.remove([blocks[2].key]) == 1
        tier.flush()  # the writer thread deletes, in order with the writes
        assert len(r.keys("prefixcache:{*}:t")) == 2  # removed with its block
        r.delete(Names("prefixcache").meta(blocks[1].key))  # as if the server evicted it
        plan = plan_gc(tier.client, Names("prefixcache"), model=None, older_than=None)
        run_gc(tier.client, Names("prefixcache"), plan)
        assert r.keys("prefixcache:{*}:t") == [Names("prefixcache").tenant(blocks[0].key).encode()]
    finally:
        tier.close()
