"""The SSD tier: an LMDB index and checksummed safetensors payload files in one directory."""

from .tier import SsdTier

__all__ = ["SsdTier"]
