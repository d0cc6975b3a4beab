"""A cheap fingerprint of a model's weights, used when no model_id is given."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import xxhash
from mlx.utils import tree_flatten

_SAMPLES = 4096  # values sampled per parameter: fine-tunes differ almost everywhere


def model_fingerprint(model: nn.Module) -> str:
    """``"fp:<hex>"`` from every parameter's name, shape, dtype and sampled values.

    Reads a strided sample, not every weight, so it costs milliseconds on
    multi-gigabyte models; pass an explicit ``model_id`` to avoid relying on it.
    """
    hasher = xxhash.xxh3_128()
    hasher.update(type(model).__module__.encode())
    for name, param in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        hasher.update(f"{name}:{param.shape}:{param.dtype}".encode())
        flat = param.reshape(-1)
        stride = max(1, flat.size // _SAMPLES)
        sample = flat[::stride]
        if sample.dtype == mx.bfloat16:
            sample = sample.view(mx.uint16)
        hasher.update(np.array(sample).tobytes())
    return "fp:" + hasher.hexdigest()
