"""Codecs: one per cache family, looked up by cache class in a public registry.

A third-party cache plugs in by subclassing :class:`Codec` and calling
:func:`register_codec` before the PrefixCache is built.
"""

from .base import (
    Builder,
    Codec,
    LayoutMismatchError,
    UnsupportedCacheError,
    round_up,
)
from .kv import KVCodec
from .quantized import QuantizedKVCodec
from .registry import codec_for, register_codec, unregister_codec

for _codec in (KVCodec(), QuantizedKVCodec()):
    register_codec(_codec, replace=True)

__all__ = [
    "Builder",
    "Codec",
    "KVCodec",
    "LayoutMismatchError",
    "QuantizedKVCodec",
    "UnsupportedCacheError",
    "codec_for",
    "register_codec",
    "round_up",
    "unregister_codec",
]
