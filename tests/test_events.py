"""KV events: a real ZeroMQ SUB socket decodes every store and eviction of every tier,
in order, in vLLM's layout, with nothing lost at the store rate reached (recorded)."""

from __future__ import annotations

import re
import time

import msgspec
import pytest
import zmq
from conftest import prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.background.kv_events import AllBlocksCleared, KVEventBatch, block_hash

BLOCK = 16


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def receive(sub: zmq.Socket, until_idle_ms: int = 500) -> list[tuple[int, KVEventBatch]]:
    """Every (seq, batch) until nothing arrives for ``until_idle_ms``."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    while sub.poll(until_idle_ms):
        _topic, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return out


@pytest.fixture
def subscriber():
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.set_hwm(0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    yield port, sub
    sub.close(linger=0)


def test_every_store_and_eviction_of_every_tier_in_order(
    tmp_path, llama, subscriber, record_property
):
    port, sub = subscriber
    tokens = prompt(1, BLOCK)
    cache = make_prompt_cache(llama)
    prefill(llama, tokens, cache, step=BLOCK)
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        hot_max_bytes=2 * 8192,
        ssd_max_bytes=3 * 8192 + 3 * 1024,
        events_url=f"tcp://*:{port}",
        counters_save_seconds=0,
    )
    num_stores = 1200
    with PrefixCache(llama, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        began = time.perf_counter()
        for i in range(num_stores):  # one new block each (its own root)
            pc.store(prompt(100 + i, BLOCK), cache)
        rate = num_stores / (time.perf_counter() - began)
        pc.flush()
        pc.services.events.flush()
        st = pc.stats()
    batches = receive(sub)
    assert [seq for seq, _ in batches] == list(range(len(batches)))  # no batch lost
    assert type(batches[0][1].events[0]) is AllBlocksCleared  # a publisher's first event
    medium = {"GPU": "hot", "STORAGE": "ssd"}  # vLLM's media (both tiers are LOCAL)
    events = [
        (type(e).__name__, medium[e.medium], e)
        for _, b in batches
        for e in b.events
        if type(e) is not AllBlocksCleared
    ]
    assert {e.locality for _, _, e in events} == {"LOCAL"}
    stored = {
        m: [e for n, med, e in events if n == "BlockStored" and med == m] for m in ("hot", "ssd")
    }
    removed = {
        m: sum(len(e.block_hashes) for n, med, e in events if n == "BlockRemoved" and med == m)
        for m in ("hot", "ssd")
    }
    assert len(stored["hot"]) == num_stores  # every store
    assert removed["hot"] == st["hot"]["num_evictions"] > 0  # every hot eviction
    assert len(stored["ssd"]) == st["ssd"]["num_writes"] > 0  # every SSD write
    assert removed["ssd"] == st["ssd"]["num_evictions"] > 0  # every SSD eviction
    first = stored["hot"][0]
    assert (
        first.block_size == BLOCK
        and len(first.token_ids) == BLOCK
        and first.parent_block_hash is None
    )
    # in order: each block is stored in a tier before it is removed from it
    seen: dict[tuple[str, int], str] = {}
    for name, medium, e in events:
        for h in e.block_hashes:
            if name == "BlockRemoved":
                assert seen.get((medium, h)) == "stored", (medium, h)
            seen[(medium, h)] = "stored" if name == "BlockStored" else "removed"
    # nothing lost at the rate reached (tools/bench_events.py paces it and compares)
    record_property("stores_per_second", round(rate))
    assert len(events) + 1 == st["events"]["num_events"] and st["events"]["num_dropped"] == 0


def test_first_block_hash_and_parent_link(tmp_path, llama, subscriber):
    port, sub = subscriber
    tokens = prompt(2, 3 * BLOCK)
    cache = make_prompt_cache(llama)
    prefill(llama, tokens, cache, step=BLOCK)
    cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, events_url=f"tcp://*:{port}")
    with PrefixCache(llama, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(tokens, cache)
        pc.services.events.flush()
        from prefixcache.hashing import chain_keys, token_bytes

        keys = chain_keys(pc.namespace.root_key(), token_bytes(tokens), BLOCK)
    events = [e for _, b in receive(sub) for e in b.events if type(e) is not AllBlocksCleared]
    assert [e.block_hashes[0] for e in events] == [block_hash(k) for k in keys]
    assert [e.parent_block_hash for e in events] == [None, block_hash(keys[0]), block_hash(keys[1])]
    assert [e.token_ids for e in events] == [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]


def test_an_events_url_that_cannot_bind_is_named(llama, subscriber):
    port, _ = subscriber
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind(f"tcp://*:{port + 1}" if port < 65535 else "tcp://*:1025")
    url = taken.getsockopt(zmq.LAST_ENDPOINT).decode().replace("0.0.0.0", "*")
    try:
        with pytest.raises(ValueError, match=re.escape(f"events_url '{url}'")):
            PrefixCache(llama, CacheConfig(hot_cache_only=True, events_url=url))
    finally:
        taken.close(linger=0)


def test_remote_tier_stores_and_removals_are_published(llama, subscriber, redis_server):
    port, sub = subscriber
    tokens = prompt(3, 3 * BLOCK)
    cache = make_prompt_cache(llama)
    prefill(llama, tokens, cache, step=BLOCK)
    cfg = CacheConfig(
        block_size=BLOCK,
        hot_cache_only=True,
        remote_url=redis_server.url,
        events_url=f"tcp://*:{port}",
    )
    with PrefixCache(llama, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(tokens, cache, session="s")
        pc.flush()
        assert pc.end_session("s") == 3
        pc.services.events.flush()
        from prefixcache.hashing import chain_keys, token_bytes

        hashes = [
            block_hash(k) for k in chain_keys(pc.namespace.root_key(), token_bytes(tokens), BLOCK)
        ]
    remote = ("STORAGE", "REMOTE")  # vLLM's storage medium, on another host
    events = [
        e
        for _, b in receive(sub)
        for e in b.events
        if type(e) is not AllBlocksCleared and (e.medium, e.locality) == remote
    ]
    stored = [e.block_hashes[0] for e in events if type(e).__name__ == "BlockStored"]
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert stored == hashes and sorted(removed) == sorted(hashes)
    names = [type(e).__name__ for e in events]
    assert names.index("BlockRemoved") > max(i for i, n in enumerate(names) if n == "BlockStored")
