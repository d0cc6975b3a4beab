"""A restored cache mlx-lm's batch takes without copying it.

mlx-lm's batch path (0.32.2) merges the caches of the prompts it starts into
one ``BatchKVCache`` per layer (``_merge_caches`` calls the first cache's
``merge``): a new zero-filled buffer the restored K/V are copied into. Its
first prefill step then finds the buffer full and copies it again, into one
with room for the step (``BatchKVCache.update_and_fetch``). mlx-lm's own
prompt cache pays both copies too; ours paid a third, the gather of the blocks.

So the server adapter gives each restored plain-attention layer (``KVCache``,
restored with room for the prompt's rest: ``restore_headroom``, 1 in
``prefixcache serve``) a ``merge`` of its own. A batch of one prompt takes its
buffer as it is, and the prefill writes in place: the gather is the only copy.
A batch of several prompts is merged as mlx-lm merges it. mlx-lm's merge of a
cache whose buffer is too short also stays right: the first step then copies.

The room is given only to a request the server takes while its batch is idle
(``TieredPromptCache.batch_busy``, set by generator.py: mlx-lm waits for a
request only then). One taken while others are in flight queues behind them
or joins them (merged, so copied, anyway), and mlx-lm trims the prompt cache
after each admission to its budget less the bytes of every cache in the batch,
queued ones included: under overload, a buffer for its whole prompt held by
each queued request emptied the hot tier (docs/capacity.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import BatchKVCache, KVCache


def batch_ready(cache: list[Any]) -> list[Any]:
    """``cache``, each restored ``KVCache`` layer given the merge below (an instance
    attribute: the layer stays a ``KVCache`` for everything else)."""
    for layer in cache:
        if type(layer) is KVCache and layer.keys is not None:
            layer.merge = merge
    return cache


def merge(caches: Sequence[Any]) -> BatchKVCache:
    """``BatchKVCache.merge``, except that one restored cache alone is taken as is:
    its buffer becomes the batch's (its first ``offset`` tokens the K/V, the rest
    room for the prefill). mlx-lm calls the first cache's ``merge``: with one
    cache, it is the restored layer ``batch_ready`` gave this merge."""
    if len(caches) != 1:
        return BatchKVCache.merge(caches)
    layer = caches[0]
    batch = BatchKVCache([0])
    batch.keys, batch.values = layer.keys, layer.values
    batch.offset = batch.offset + layer.offset
    batch._idx = layer.offset
    return batch
