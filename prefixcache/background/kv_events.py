"""The KV-events wire layout: vLLM's structures and constants, as
``vllm.distributed.kv_events`` defines them now (its field lists, rebuilt: vLLM
needs torch), so consumers built for vLLM read our events as they are (SGLang's
own structures: sglang_events.py).

A message's payload is a msgspec-msgpack ``KVEventBatch``, a positional array
``[ts, [events...], data_parallel_rank]`` whose events are maps tagged by
``type``::

    {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p | None,
     "token_ids": [...], "block_size": n, "lora_id": None, "medium": "GPU",
     "lora_name": None, "extra_keys": [...], "group_idx": 0,
     "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": w,
     "locality": "LOCAL"}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU",
     "group_idx": 0, "locality": "LOCAL"}
    {"type": "AllBlocksCleared"}

Fields left at their default (None) are omitted, as vLLM's encoder does.
``medium`` and ``locality`` name the tier with vLLM's constants (``TIER_MEDIUM``):
``hot`` is ``GPU`` (its live arrays sit in the device's memory: unified on
Apple silicon), ``ssd`` is ``STORAGE`` and ``LOCAL``, ``remote`` is
``STORAGE`` and ``REMOTE`` (another host's server). ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` name the layout's
cache groups, one per kind of layer (vLLM's ``KVCacheSpecKind`` values).
A block hash is the first 8 bytes of the block's 128-bit chain key as an
unsigned big-endian int (``block_hash``). Needs the ``events`` extra (msgspec).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's device-memory medium
MEDIUM_CPU = "CPU"  # vLLM's host-memory offload medium (unused: hot is device memory here)
MEDIUM_STORAGE = "STORAGE"  # vLLM's storage offload medium
LOCAL, REMOTE = "LOCAL", "REMOTE"  # vLLM's locality: relative to the publisher
TIER_MEDIUM = {
    "hot": (MEDIUM_GPU, LOCAL),
    "ssd": (MEDIUM_STORAGE, LOCAL),
    "remote": (MEDIUM_STORAGE, REMOTE),
}
FULL_ATTENTION = ("full_attention", None)  # the group of a layout of plain K/V layers


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a map tagged ``type`` with the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def block_hash(key: bytes) -> int:
    """The published hash of a block key: its first 8 bytes, unsigned big-endian."""
    return int.from_bytes(key[:8], "big")


Extra = tuple[tuple[str, str], ...]  # a namespace's extra keys, sorted (name, value)


class VllmForm:
    """Events as vLLM publishes them: a block once per cache group, the tier as
    ``medium`` and ``locality``, a salted chain's values on its first block.

    Args:
        block_size: tokens per block.
        groups: the layout's cache groups, ``(kv_cache_spec_kind, sliding window)``.
    """

    def __init__(self, block_size: int, groups: Sequence[tuple[str, int | None]]) -> None:
        self.block_size, self.groups = block_size, tuple(groups) or (FULL_ATTENTION,)

    def stored(
        self, tier: str, key: int, parent: int | None, tokens: list[int], extra: Extra
    ) -> list[KVCacheEvent]:
        medium, locality = TIER_MEDIUM[tier]
        keys = [tuple(value for _, value in extra)] if extra else None
        return [
            BlockStored(
                [key],
                parent,
                tokens,
                self.block_size,
                None,
                medium,
                None,
                extra_keys=keys,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                locality=locality,
            )
            for group, (kind, window) in enumerate(self.groups)
        ]

    def removed(self, tier: str, keys: list[int]) -> list[KVCacheEvent]:
        medium, locality = TIER_MEDIUM[tier]
        return [
            BlockRemoved(keys, medium, group_idx=group, locality=locality)
            for group in range(len(self.groups))
        ]

    def cleared(self) -> KVCacheEvent:
        return AllBlocksCleared()

    def batch(self, ts: float, events: list[Any]) -> msgspec.Struct:
        return KVEventBatch(ts, events, 0)  # rank 0, as vLLM's publisher sets it
