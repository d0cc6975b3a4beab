"""The SSD tier: an LMDB index (index.py, records.py) and safetensors payload files
(payload.py) written by a background writer (writer.py) and streamed back by
reader threads (stream.py, readers.py)."""

from .tier import SsdTier

__all__ = ["SsdTier"]
