"""vLLM's own KV-event structures decode our frames: every event kind, every field, every tier.

vLLM needs torch, so its structures are rebuilt here from the field lists of
``vllm/distributed/kv_events.py`` (``EventBatch`` a positional array, events
maps tagged by class name; ``ExternalBlockHash`` = bytes | int). A typed
msgspec decoder checks every field's type as it decodes; a negative control
shows vLLM's older array-form events and a wrong field type do not decode.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_events import receive, subscriber  # noqa: F401  (a fixture)

from prefixcache import CacheConfig, PrefixCache
from prefixcache.background.kv_events import block_hash
from prefixcache.hashing import chain_keys, token_bytes

BLOCK = 16
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoded(sub: zmq.Socket, batch_type: type = KVEventBatch) -> list[Any]:
    """Every event received, decoded with ``batch_type``."""
    decode = msgspec.msgpack.Decoder(type=batch_type).decode
    out = []
    while sub.poll(500):
        _topic, _seq, payload = sub.recv_multipart()
        out += decode(payload).events
    return out


def raw_payloads(sub: zmq.Socket) -> list[bytes]:
    out = []
    while sub.poll(500):
        out.append(sub.recv_multipart()[2])
    return out


def windowed_run(tmp_path, sub_port: int) -> dict:
    """A sliding-window hybrid (gemma3: window and full-attention layers) with hot
    and SSD tiers small enough to evict from both; one salted chain among them."""
    model = tiny_model("gemma3_text")
    salted = prompt(7, 3 * BLOCK)
    cache = make_prompt_cache(model)
    prefill(model, salted, cache, step=BLOCK)
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        hot_max_bytes=4 * 32768,
        ssd_max_bytes=8 * 40000,
        events_url=f"tcp://*:{sub_port}",
        counters_save_seconds=0,
    )
    with PrefixCache(model, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(salted, cache, extra={"cache_salt": "tenant-a"})
        one = make_prompt_cache(model)
        prefill(model, prompt(8, BLOCK), one, step=BLOCK)
        for i in range(30):  # one-block chains: push the others out of hot, then SSD
            pc.store(prompt(100 + i, BLOCK), one)
        pc.flush()
        pc.services.events.flush()
        root = pc.namespace.with_extra({"cache_salt": "tenant-a"}).root_key()
        keys = chain_keys(root, token_bytes(salted), BLOCK)
        return {"stats": pc.stats(), "salted": [block_hash(k) for k in keys], "tokens": salted}


def test_vllm_structures_decode_every_kind_and_field(tmp_path, subscriber):  # noqa: F811
    port, sub = subscriber
    run = windowed_run(tmp_path, port)
    events = decoded(sub)
    st = run["stats"]
    assert st["hot"]["num_evictions"] > 0 and st["ssd"]["num_evictions"] > 0, st
    assert type(events[0]) is AllBlocksCleared
    stored = [e for e in events if type(e) is BlockStored]
    removed = [e for e in events if type(e) is BlockRemoved]
    # the tiers as vLLM names them: hot on the device, SSD local storage
    media = {("GPU", "LOCAL"), ("STORAGE", "LOCAL")}
    assert {(e.medium, e.locality) for e in stored} == media
    assert {(e.medium, e.locality) for e in removed} == media
    # gemma3's two cache groups: a block is published once per group
    groups = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert groups == {(0, "sliding_window", BLOCK), (1, "full_attention", None)}
    assert {e.group_idx for e in removed} == {0, 1}
    for e in stored:
        assert e.block_size == BLOCK and len(e.token_ids) == BLOCK and len(e.block_hashes) == 1
        assert e.lora_id is None and e.lora_name is None  # an adapter is part of the model id
    # the salted chain: its hashes, parents, tokens; the salt on its first block only
    hot = [e for e in stored if e.medium == "GPU" and e.group_idx == 1]
    chain = [e for e in hot if e.block_hashes[0] in run["salted"]]
    assert [e.block_hashes[0] for e in chain] == run["salted"]
    assert [e.parent_block_hash for e in chain] == [None, *run["salted"][:2]]
    assert [e.token_ids for e in chain] == [
        run["tokens"][i * BLOCK : (i + 1) * BLOCK] for i in range(3)
    ]
    assert [e.extra_keys for e in chain] == [[("tenant-a",)], None, None]
    assert all(e.extra_keys is None for e in hot if e not in chain)  # unsalted: none
    # every field of vLLM's BlockStored carried a value somewhere, but the LoRA ones
    carried = {f for e in stored for f in e.__struct_fields__ if getattr(e, f) is not None}
    assert carried == set(BlockStored.__struct_fields__) - {"lora_id", "lora_name"}
    carried = {f for e in removed for f in e.__struct_fields__ if getattr(e, f) is not None}
    assert carried == set(BlockRemoved.__struct_fields__)


def test_remote_tier_is_vllm_storage_at_remote_locality(subscriber, redis_server):  # noqa: F811
    port, sub = subscriber
    model = tiny_model("llama")
    tokens = prompt(3, 2 * BLOCK)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    cfg = CacheConfig(
        block_size=BLOCK,
        hot_cache_only=True,
        remote_url=redis_server.url,
        events_url=f"tcp://*:{port}",
    )
    with PrefixCache(model, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(tokens, cache, session="s")
        pc.flush()
        assert pc.end_session("s") == 2
        pc.services.events.flush()
    events = [e for e in decoded(sub) if type(e) is not AllBlocksCleared]
    remote = [e for e in events if e.locality == "REMOTE"]
    assert {(type(e).__name__, e.medium) for e in remote} == {
        ("BlockStored", "STORAGE"),
        ("BlockRemoved", "STORAGE"),
    }
    assert {(e.group_idx, e.kv_cache_spec_kind) for e in remote if type(e) is BlockStored} == {
        (0, "full_attention")
    }


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


class StrHashStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class StrHashBatch(EventBatch):
    events: list[StrHashStored | BlockRemoved | AllBlocksCleared]


def test_negative_control_other_structures_do_not_decode(subscriber):  # noqa: F811
    """The decode above is strict: vLLM's older array-form events, and a field of
    another type, are refused on the same frames."""
    port, sub = subscriber
    model = tiny_model("llama")
    tokens = prompt(4, 2 * BLOCK)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, events_url=f"tcp://*:{port}")
    with PrefixCache(model, cfg, model_id="m") as pc:
        assert pc.services.events.wait_for_subscriber(10)
        pc.store(tokens, cache)
        pc.services.events.flush()
    payloads = raw_payloads(sub)
    assert payloads
    for batch_type in (OldBatch, StrHashBatch):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.Decoder(type=batch_type).decode(payloads[0])
    assert len(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payloads[0]).events) == 3


@pytest.mark.parametrize(
    ("arch", "groups"),
    [
        ("llama", (("full_attention", None),)),
        ("gemma3_text", (("sliding_window", 16), ("full_attention", None))),
        ("qwen3_next", (("mamba", None), ("full_attention", None))),
    ],
)
def test_cache_groups_of_a_layout(arch, groups):
    """The groups a layout publishes, in vLLM's kinds: by layer order, one per kind."""
    with PrefixCache(tiny_model(arch), CacheConfig(hot_cache_only=True)) as pc:
        assert pc.layout.groups == groups
