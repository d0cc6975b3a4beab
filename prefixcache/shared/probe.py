"""Can a model attend over shared prefixes? Found out by running it once.

A model is covered when each layer that could be shared computes its attention
through mlx-lm's ``scaled_dot_product_attention`` with the keys its cache
returned (the hook then splits it). That is a property of the model's code, so
it is checked by running it: two tokens into plain caches, shared, then one
token with the hook installed; every shared layer must have reached
``attend`` exactly once. A model that computes attention itself (gemma2) or
transforms the fetched keys is not covered: ``fetch(shared=True)`` gives it
private copies, counted as a fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..hashing import token_bytes
from .attention import Quant
from .build import kind_of, sequence, share
from .hook import SharedAttention, hooked
from .prefix import LayerKind

NOT_HOOKED = "attention_not_hooked"
NO_SHARED_LAYER = "no_shared_layer"


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """Which layers of a model are shared, and whether it can share at all.

    Attributes:
        kinds: per layer, its shared kind at full precision (None: private).
        reason: why the model cannot share (``NOT_HOOKED``, ``NO_SHARED_LAYER``),
            or None.
    """

    kinds: tuple[LayerKind | None, ...]
    reason: str | None

    def at(self, quant: Quant | None) -> list[LayerKind | None]:
        """The kinds of caches whose full-attention K/V are packed by ``quant``."""
        return [
            k if k is None or k.window is not None or quant is None else replace(k, quant=quant)
            for k in self.kinds
        ]


def probe(model: nn.Module, signatures: Sequence[tuple[object, ...]]) -> SharedLayout:
    """Run ``model`` on 3 tokens to see which layers share and whether the hook sees them."""
    tokens = [1, 2]
    plain = make_prompt_cache(model)
    model(mx.array([tokens]), cache=plain)
    mx.eval([c.state for c in plain])
    kinds = tuple(kind_of(c, s) for c, s in zip(plain, signatures, strict=True))
    if all(k is None for k in kinds):
        return SharedLayout(kinds, NO_SHARED_LAYER)
    caches = sequence(share(b"", token_bytes(tokens), plain, len(tokens), signatures), len(tokens))
    with hooked():
        mx.eval(model(mx.array([[3]]), cache=caches))
    shared = [c for c in caches if isinstance(c, SharedAttention)]
    if any(c.num_attends != 1 or c.num_dense for c in shared):
        return SharedLayout(kinds, NOT_HOOKED)
    return SharedLayout(kinds, None)
