"""Codecs: one per cache family, looked up by cache class in a public registry.

The built-in codecs (KVCache, QuantizedKVCache, RotatingKVCache,
ChunkedKVCache, ArraysCache, CacheList) are registered on import; a cache
class of another package plugs in with its own :class:`Codec` and
:func:`register_codec` (the contract and an example: ``codecs.base``).
"""

from ..errors import LayoutMismatchError, UnsupportedCacheError
from .arrays import ArraysCodec
from .base import Builder, Codec, Has, Payload, Resident, num_blocks, round_up
from .cachelist import CacheListCodec
from .chunked import ChunkedKVCodec
from .kv import KVCodec
from .quantized import QuantizedKVCodec
from .registry import codec_for, register_codec, unregister_codec
from .rotating import RotatingKVCodec

for _codec in (
    KVCodec(),
    QuantizedKVCodec(),
    RotatingKVCodec(),
    ChunkedKVCodec(),
    ArraysCodec(),
    CacheListCodec(),
):
    register_codec(_codec, replace=True)

__all__ = [
    "ArraysCodec",
    "Builder",
    "CacheListCodec",
    "ChunkedKVCodec",
    "Codec",
    "Has",
    "KVCodec",
    "LayoutMismatchError",
    "Payload",
    "QuantizedKVCodec",
    "Resident",
    "RotatingKVCodec",
    "UnsupportedCacheError",
    "codec_for",
    "num_blocks",
    "register_codec",
    "round_up",
    "unregister_codec",
]
