"""Codecs: one per cache family, looked up by cache class in a public registry.

Built in (registered on import):

=====================  ==============================================================
cache class            payload per block
=====================  ==============================================================
KVCache                ``keys``, ``values``: the block's slice of the token axis
QuantizedKVCache       ``keys.q|scales|biases``, ``values.*``: packed, never dequantized
RotatingKVCache        ``keys``, ``values`` while in the window (``keep.*``: first tokens)
ChunkedKVCache         ``keys``, ``values`` while in the current chunk
ArraysCache            ``0``, ``1``, ...: state snapshot at the block's end boundary
CacheList              each part's payload under ``"{part}."``
LayerCache             ``c.*``: compressed rows; ``w.*``: window and open-group rows
UnusedKVCache          nothing: a layer the model never writes (no-op attention)
=====================  ==============================================================

Registering a third-party cache
-------------------------------
A cache class of another package (a TurboQuant-style quantized cache, say)
plugs in by subclassing :class:`Codec` and calling :func:`register_codec`
before a ``PrefixCache`` is built for a model that uses it::

    from prefixcache.codecs import Builder, Codec, register_codec


    class MyCodec(Codec):
        cache_type = MyCache                       # looked up by exact class
        def layout(self, cache): ...               # namespace signature (hashable, JSON-able)
        def length(self, cache): return cache.offset
        def cut(self, cache, start, end, *, length, snapshot=True):
            return {"q": ..., "scales": ...}       # new arrays of tokens [start, end)
        def builder(self, fresh, num_tokens, capacity, block_size): return MyBuilder(...)

    register_codec(MyCodec())

A :class:`Builder` receives each needed block's payload in chain order
(``add``), exposes the arrays to evaluate after each block (``buffers``) and
returns the rebuilt cache (``finish``); it must give the cache new arrays,
never the payload's own objects. Optional hooks, each with its default on
:class:`Codec`: ``blocks_needed`` (a window needs only its last blocks),
``missing`` (which needed block's stored payload cannot serve the layer, and
why; judged before anything is copied), ``trimmable_at`` and ``reach``
(blocks that may gain a payload from a later capture). Lookup is by exact
class: a subclass of a built-in cache needs its own codec. A cache class with
no codec is refused with :class:`UnsupportedCacheError` when the
``PrefixCache`` is built. The ``layout`` of a cache is part of the hash
namespace, so blocks of one codec's layout are never served to another.
"""

from ..errors import LayoutMismatchError, UnsupportedCacheError
from .arrays import ArraysCodec
from .base import Builder, Codec, Has, Payload, Resident, num_blocks, round_up
from .cachelist import CacheListCodec
from .chunked import ChunkedKVCodec
from .compressed import CompressedCodec
from .kv import KVCodec
from .quantized import QuantizedKVCodec
from .registry import codec_for, register_codec, unregister_codec
from .rotating import RotatingKVCodec
from .unused import UnusedCodec, UnusedKVCache

for _codec in (
    KVCodec(),
    QuantizedKVCodec(),
    RotatingKVCodec(),
    ChunkedKVCodec(),
    ArraysCodec(),
    CacheListCodec(),
    CompressedCodec(),
    UnusedCodec(),
):
    register_codec(_codec, replace=True)

__all__ = [
    "ArraysCodec",
    "Builder",
    "CacheListCodec",
    "ChunkedKVCodec",
    "Codec",
    "CompressedCodec",
    "Has",
    "KVCodec",
    "LayoutMismatchError",
    "Payload",
    "QuantizedKVCodec",
    "Resident",
    "RotatingKVCodec",
    "UnsupportedCacheError",
    "UnusedCodec",
    "UnusedKVCache",
    "codec_for",
    "num_blocks",
    "register_codec",
    "round_up",
    "unregister_codec",
]
