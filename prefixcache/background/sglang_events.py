"""The KV-events wire layout in SGLang's form (``sglang.srt.disaggregation.kv_events``),
for consumers that decode with SGLang's own structures (``events_format="sglang"``).

Every SGLang release publishes its events as positional arrays tagged by class
name, in a positional batch ``[ts, [events...], attn_dp_rank]``::

    ["BlockStored", [h], parent | None, [token ids], block_size, None, "GPU"]
    ["BlockStored", [h], None, [token ids], block_size, None, "GPU", {"cache_salt": s}]
    ["BlockRemoved", [h, ...], "GPU"]
    ["AllBlocksCleared"]

with SGLang's ``StorageMedium`` names: ``hot`` is ``GPU``, ``ssd`` is ``DISK``,
``remote`` is ``EXTERNAL`` (its shared or remote pool). A salted chain's first
block carries SGLang's trailing metadata map (``BlockStoredWithMetadata``).
SGLang has no cache groups: a block is published once. Needs msgspec.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .kv_events import Extra

MEDIUM = {"hot": "GPU", "ssd": "DISK", "remote": "EXTERNAL"}  # SGLang's StorageMedium


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event: a positional array whose first element is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only=True):
    metadata: BlockStoredMetadata


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglangForm:
    """Events as SGLang publishes them (one per block; its medium names)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def stored(
        self, tier: str, key: int, parent: int | None, tokens: list[int], extra: Extra
    ) -> list[Any]:
        salt = dict(extra).get("cache_salt")
        head = ([key], parent, tokens, self.block_size, None, MEDIUM[tier])
        if salt is None:
            return [BlockStored(*head)]
        return [BlockStoredWithMetadata(*head, metadata=BlockStoredMetadata(salt))]

    def removed(self, tier: str, keys: list[int]) -> list[Any]:
        return [BlockRemoved(keys, MEDIUM[tier])]

    def cleared(self) -> Any:
        return AllBlocksCleared()

    def batch(self, ts: float, events: list[Any]) -> msgspec.Struct:
        return EventBatch(ts, events, 0)  # rank 0, as SGLang's publisher sets it
