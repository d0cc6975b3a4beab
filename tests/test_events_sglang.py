"""``events_format="sglang"``: SGLang's own KV-event structures decode our frames (every
event kind, every field, every tier), and radixview reads them too.

SGLang's structures are rebuilt here from the field lists of
``sglang/srt/disaggregation/kv_events.py`` (events and batch positional arrays,
``StorageMedium`` names, ``BlockStoredWithMetadata``'s trailing map); vLLM's
current structures refuse the same frames (the control).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from radixview.wire import decode_multipart, format_event
from test_events import subscriber  # noqa: F401  (a fixture)
from test_events_vllm import KVEventBatch as VllmBatch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.background.kv_events import block_hash
from prefixcache.hashing import chain_keys, token_bytes

BLOCK = 16


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    # BlockStoredWithMetadata's trailing map, decoded in place of its own tag
    metadata: BlockStoredMetadata | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


def run(tmp_path, port: int, *, remote_url: str | None = None) -> tuple[list, list[int]]:
    """A salted 3-block chain, then one-block chains that evict from every tier:
    (every message's frames, the salted chain's hashes)."""
    model = tiny_model("llama")
    salted = prompt(7, 3 * BLOCK)
    cache = make_prompt_cache(model)
    prefill(model, salted, cache, step=BLOCK)
    lower = {"remote_url": remote_url, "hot_cache_only": True} if remote_url else {}
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        hot_max_bytes=4 * 8192,
        ssd_max_bytes=6 * 9216,
        events_url=f"tcp://*:{port}",
        events_format="sglang",
        counters_save_seconds=0,
        ssd_run_tokens=0,  # no batch waits for more: each block's write evicts for itself
        **lower,
    )
    with PrefixCache(model, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(salted, cache, extra={"cache_salt": "tenant-a"}, session="s")
        one = make_prompt_cache(model)
        prefill(model, prompt(8, BLOCK), one, step=BLOCK)
        for i in range(20):
            pc.store(prompt(100 + i, BLOCK), one)
        pc.flush()
        if remote_url:
            pc.end_session("s")  # the remote tier's removals
        pc.services.events.flush()
        root = pc.namespace.with_extra({"cache_salt": "tenant-a"}).root_key()
        hashes = [block_hash(k) for k in chain_keys(root, token_bytes(salted), BLOCK)]
        st = pc.stats()
    if not remote_url:
        assert st["hot"]["num_evictions"] > 0 and st["ssd"]["num_evictions"] > 0, st
    return hashes


def messages(sub) -> list[list[bytes]]:
    out = []
    while sub.poll(500):
        out.append(sub.recv_multipart())
    return out


def test_sglang_structures_decode_every_kind_and_field(tmp_path, subscriber):  # noqa: F811
    port, sub = subscriber
    salted = run(tmp_path, port)
    got = messages(sub)
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    batches = [decode(m[2]) for m in got]
    assert {b.attn_dp_rank for b in batches} == {0}
    events = [e for b in batches for e in b.events]
    assert type(events[0]) is AllBlocksCleared
    kinds = {(type(e).__name__, e.medium) for e in events if type(e) is not AllBlocksCleared}
    # SGLang's media: hot is GPU, the SSD tier DISK
    assert kinds == {(k, m) for k in ("BlockStored", "BlockRemoved") for m in ("GPU", "DISK")}
    stored = [e for e in events if type(e) is BlockStored]
    assert all(e.block_size == BLOCK and len(e.token_ids) == BLOCK for e in stored)
    assert all(e.lora_id is None for e in stored)
    chain = [e for e in stored if e.medium == "GPU" and e.block_hashes[0] in salted]
    assert [e.block_hashes[0] for e in chain] == salted
    assert [e.parent_block_hash for e in chain] == [None, *salted[:2]]
    # the salt: SGLang's trailing metadata map, on the chain's first block only
    assert [e.metadata for e in chain] == [BlockStoredMetadata("tenant-a"), None, None]
    carried = {f for e in stored for f in e.__struct_fields__ if getattr(e, f) is not None}
    assert carried == set(BlockStored.__struct_fields__) - {"lora_id"}
    # radixview reads this form too: the salt in its log line, the medium
    first = [decode_multipart(m).events for m in got]
    lines = [format_event(e) for es in first for e in es]
    assert any(f"hash={salted[0]}" in line and "cache_salt=tenant-a" in line for line in lines)
    assert any("medium=DISK" in line for line in lines)
    # control: vLLM's current structures (maps) refuse SGLang's arrays
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(type=VllmBatch).decode(got[0][2])


def test_sglang_remote_tier_is_external(tmp_path, subscriber, redis_server):  # noqa: F811
    port, sub = subscriber
    salted = run(tmp_path, port, remote_url=redis_server.url)
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    events: list[Any] = [e for m in messages(sub) for e in decode(m[2]).events]
    remote = [e for e in events if type(e) is not AllBlocksCleared and e.medium == "EXTERNAL"]
    stored = [e.block_hashes[0] for e in remote if type(e) is BlockStored]
    removed = {h for e in remote if type(e) is BlockRemoved for h in e.block_hashes}
    assert set(salted) <= set(stored) and set(salted) <= removed
