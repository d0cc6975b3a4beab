"""Registry of codecs keyed by cache class.

Lookup is by exact class: a subclass may store its state differently (a
third-party quantized cache deriving from KVCache, say), so it must register
its own codec rather than be cut as its base.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedCacheError
from .base import Codec

_CODECS: dict[type, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False) -> None:
    """Make ``codec`` handle ``codec.cache_type``.

    Raises:
        ValueError: a codec is registered for that class already and not ``replace``.
    """
    cls = codec.cache_type
    if cls in _CODECS and not replace:
        raise ValueError(f"a codec for {cls.__qualname__} is registered already")
    _CODECS[cls] = codec


def unregister_codec(cache_type: type) -> None:
    _CODECS.pop(cache_type, None)


def codec_for(cache: Any) -> Codec:
    """The codec for a cache object's exact class.

    Raises:
        UnsupportedCacheError: no codec handles the cache's class.
    """
    codec = _CODECS.get(type(cache))
    if codec is not None:
        return codec
    known = ", ".join(sorted(c.__qualname__ for c in _CODECS))
    raise UnsupportedCacheError(
        f"no codec for cache type {type(cache).__module__}.{type(cache).__qualname__}; "
        f"registered: {known}"
    )
