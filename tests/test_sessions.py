"""Sessions, per-request persistence and SSD write governance, checked in the tiers,
the SSD index, the payload directory and the write counters."""

from __future__ import annotations

import pytest
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import chain_keys, token_bytes

BLOCK = 16
BLOCK_BYTES = 8192


def config(tmp_path, **changes) -> CacheConfig:
    base = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        counters_save_seconds=0,
        ssd_run_tokens=0,  # a file per block: the tests name each block's file
    )
    return base.replace(**changes)


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def files(tmp_path) -> set[str]:
    return {p.name.split(".")[0] for p in (tmp_path / "ssd").rglob("*.safetensors")}


def indexed(pc) -> set[str]:
    return {m.key.hex() for m in pc.ssd.iter_meta()}


def server_blocks(client, keys) -> set[bytes]:
    """Which of ``keys`` (block keys) still have a key on the remote server."""
    names = [k.decode() for k in client.scan_iter("prefixcache*", count=1000)]
    return {k for k in keys if any(k.hex() in name for name in names)}


@pytest.fixture(scope="module")
def convo(llama):
    shared = prompt(1, 4 * BLOCK)  # a system prompt both sessions use
    a = shared + prompt(2, 3 * BLOCK + 5)
    b = shared + prompt(3, 2 * BLOCK + 7)
    return shared, (a, filled(llama, a)), (b, filled(llama, b))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_end_session_drops_only_its_blocks_from_every_tier(tmp_path, llama, convo, policy):
    shared, (a, cache_a), (b, cache_b) = convo
    with PrefixCache(llama, config(tmp_path, write_policy=policy), model_id="m") as pc:
        pc.store(a, cache_a, session="alice")
        pc.store(b, cache_b, session="bob")  # shares alice's first 4 blocks
        pc.flush()  # everything on SSD too
        before_files, before_index = files(tmp_path), indexed(pc)
        assert len(before_index) == 4 + 3 + 1 + 2 + 1  # shared, a's blocks+tail, b's
        assert pc.end_session("alice") == 4  # a's 3 own blocks and its tail
        gone = before_index - indexed(pc)
        assert len(gone) == 4 and gone == before_files - files(tmp_path)
        assert pc.match(b) == len(b) - 1  # bob's conversation, shared prefix included
        assert pc.match(a) == len(shared)  # alice's own blocks are gone from every tier
        assert not any(pc.hot.get(bytes.fromhex(k)) for k in gone)
        with pytest.raises(ValueError, match="unknown session 'alice'"):
            pc.end_session("alice")  # ended already: nothing stored is touched
        assert pc.match(b) == len(b) - 1
        assert pc.end_session("bob") == 2 + 1  # bob's own; the shared prefix stays
        assert len(indexed(pc)) == 4 and pc.match([*shared, 1]) == len(shared)


def test_session_control_without_session_keeps_everything(tmp_path, llama, convo):
    _, (a, cache_a), _ = convo
    with PrefixCache(llama, config(tmp_path), model_id="m") as pc:
        pc.store(a, cache_a)  # the control: no session tag
        pc.store(prompt(9, BLOCK), filled(llama, prompt(9, BLOCK)), session="other")
        pc.flush()
        assert pc.end_session("other") == 1
        assert pc.match(a) == len(a) - 1 and len(indexed(pc)) == 3 + 4 + 1


def test_bad_session_values_are_named(tmp_path, llama, convo):
    _, (a, cache_a), _ = convo
    with PrefixCache(llama, config(tmp_path, hot_cache_only=True)) as pc:
        with pytest.raises(ValueError, match="unknown session 'nobody'"):
            pc.end_session("nobody")
        with pytest.raises(TypeError, match="session must be a str, got 7"):
            pc.store(a, cache_a, session=7)
        with pytest.raises(ValueError, match="session must be 1 to 256 characters"):
            pc.store(a, cache_a, session="")
        assert pc.stats()["stored_blocks"] == 0  # refused before anything was kept


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_persist_false_never_reaches_a_file(tmp_path, llama, convo, policy):
    _shared, (a, cache_a), (b, cache_b) = convo
    cfg = config(tmp_path, write_policy=policy, hot_max_bytes=6 * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(a, cache_a, persist=False)  # 7 blocks + tail, over the hot budget
        pc.flush()
        st = pc.stats()
        assert st["ssd"]["num_writes"] == 0 and files(tmp_path) == set()
        assert st["num_discarded"] >= 2  # evicted from hot: gone, never spilled
        pc.store(b, cache_b)  # the control: a persisted store writes its blocks
        pc.flush()
        # b's own blocks, its tail, and the shared prefix it walked (now its own too)
        assert pc.stats()["ssd"]["num_writes"] == len(files(tmp_path)) > 0
        assert len(files(tmp_path)) <= 4 + 2 + 1


def test_persist_false_never_reaches_the_remote_server(tmp_path, llama, convo, redis_server):
    _shared, (a, cache_a), (b, cache_b) = convo
    cfg = config(tmp_path, remote_url=redis_server.url, hot_max_bytes=6 * BLOCK_BYTES)
    client = redis_server.client()
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(a, cache_a, persist=False)  # over the hot budget: evicted, discarded
        pc.flush()
        keys_a = chain_keys(pc.namespace.root_key(), token_bytes(a), BLOCK)
        assert pc.stats()["remote"]["num_writes"] == 0 and files(tmp_path) == set()
        assert server_blocks(client, set(keys_a)) == set()
        pc.store(b, cache_b)  # the control: a persisted store reaches the server
        pc.flush()
        keys_b = chain_keys(pc.namespace.root_key(), token_bytes(b), BLOCK)
        assert server_blocks(client, set(keys_b)) == set(keys_b)
        assert pc.stats()["remote"]["num_writes"] >= len(keys_b)  # (and its tail, if kept)


def test_admit_after_2_writes_only_blocks_used_twice(tmp_path, llama, convo):
    shared, (a, cache_a), (b, cache_b) = convo
    with PrefixCache(llama, config(tmp_path, ssd_admit_after=2), model_id="m") as pc:
        pc.store(a, cache_a)
        pc.flush()
        assert pc.stats()["ssd"]["num_writes"] == 0  # seen once: waits in hot
        _cache, n = pc.fetch(b)  # restores the shared prefix: its second sighting
        assert n == len(shared)
        pc.store(b, cache_b)
        pc.flush()
        assert len(files(tmp_path)) == 4  # only the shared prefix was used twice
        pc.trim_hot(0)  # leaving hot is their last chance
        st = pc.stats()
        assert st["ssd_writes_skipped"] == 3 + 1 + 2 + 1 and len(files(tmp_path)) == 4
    with PrefixCache(llama, config(tmp_path), model_id="m") as pc:  # the control: N=1
        pc.store(a, cache_a)
        pc.flush()
        assert pc.stats()["ssd"]["num_writes"] == 4 + 3 + 1 - 4  # shared ones were there


def test_admit_after_2_takes_a_conversations_next_turn_at_once(tmp_path, llama):
    system = prompt(1, 2 * BLOCK)
    one_off = system + prompt(2, 2 * BLOCK)
    turn1 = system + prompt(3, 2 * BLOCK)  # branches off the system prompt, as one_off did
    turn2 = turn1 + prompt(4, 2 * BLOCK)  # continues turn1 from its end
    branch = turn1[: 3 * BLOCK] + prompt(5, 2 * BLOCK)  # the control: leaves turn1 inside
    cfg = config(tmp_path, ssd_admit_after=2, hot_max_bytes=64 * BLOCK_BYTES)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        for tokens in (one_off, turn1, turn2, branch):  # as a server: fetch, then store
            pc.fetch(tokens)
            pc.store(tokens, filled(llama, tokens))
        pc.trim_hot(0)  # every block leaves hot: written if admitted, else dropped
        pc.flush()
        root = pc.namespace.root_key()
        keys = {
            name: chain_keys(root, token_bytes(t), BLOCK)
            for name, t in (("one_off", one_off), ("turn2", turn2), ("branch", branch))
        }
        on_ssd = {bytes.fromhex(k) for k in indexed(pc)}
    assert set(keys["turn2"]) <= on_ssd  # its own two at once: the conversation went on
    assert not set(keys["one_off"][2:]) & on_ssd  # seen once: never written
    assert not set(keys["branch"][3:]) & on_ssd  # a branch inside turn1: seen once too
    assert set(keys["one_off"][:2]) <= on_ssd  # the shared system prompt: restored, so used


def test_write_budget_defers_then_drops_and_is_counted(tmp_path, llama, convo):
    _, (a, cache_a), (_b, _cache_b) = convo
    budget = 3 * BLOCK_BYTES  # a few blocks per day
    cfg = config(tmp_path, ssd_write_budget=budget)
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(a, cache_a)
        pc.flush()
        st = pc.stats()
        assert 0 < st["ssd"]["written_bytes"] <= budget + BLOCK_BYTES
        assert (
            st["ssd_writes_deferred"] > 0 and st["ssd_bytes_written"] == st["ssd"]["written_bytes"]
        )
        assert st["ssd"]["written_bytes_today"] == st["ssd"]["written_bytes"]
        assert st["ssd"]["write_budget"] == budget and st["ssd"]["write_budget_left"] < BLOCK_BYTES
        pc.trim_hot(0)  # deferred blocks leave hot: dropped, counted
        assert pc.stats()["ssd_writes_skipped"] > 0
        assert pc.match(a) > 0  # what was written is served


def test_budget_string_errors_name_the_value():
    with pytest.raises(ValueError, match=r"PREFIXCACHE_SSD_WRITE_BUDGET='10QB': not a byte size"):
        CacheConfig.from_env({"PREFIXCACHE_SSD_WRITE_BUDGET": "10QB"})
    with pytest.raises(ValueError, match="ssd_admit_after must be an int >= 0, got -1"):
        CacheConfig(ssd_admit_after=-1)
    with pytest.raises(ValueError, match="events_url must start with"):
        CacheConfig(events_url="http://x")
    assert (
        CacheConfig.from_env({"PREFIXCACHE_SSD_WRITE_BUDGET": "20G"}).ssd_write_budget == 20 << 30
    )


def test_end_session_removes_its_blocks_from_the_remote_server(
    tmp_path, llama, convo, redis_server
):
    shared, (a, cache_a), (b, cache_b) = convo
    cfg = config(tmp_path, remote_url=redis_server.url)
    client = redis_server.client()
    with PrefixCache(llama, cfg, model_id="m") as pc:
        pc.store(a, cache_a, session="alice")
        pc.store(b, cache_b, session="bob")
        pc.flush()
        root = pc.namespace.root_key()
        keys_a, keys_b = (chain_keys(root, token_bytes(t), BLOCK) for t in (a, b))
        own_a = set(keys_a[4:])
        assert server_blocks(client, own_a | set(keys_b)) == own_a | set(keys_b)
        assert pc.end_session("alice") == 4
        pc.flush()
        assert server_blocks(client, own_a) == set()  # alice's own: gone from the server
        assert server_blocks(client, set(keys_b)) == set(keys_b)  # shared and bob's stay
    other_host = cfg.replace(hot_cache_only=True)  # only the remote tier below hot
    with PrefixCache(llama, other_host, model_id="m") as pc:
        assert pc.match(a) == len(shared)  # the control below: bob's chain is still served
        assert pc.match(b) >= len(keys_b) * BLOCK
