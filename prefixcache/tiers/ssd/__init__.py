"""The SSD tier (tier.py) of one directory (directory.py): an LMDB index (index.py,
entries.py, space.py, records.py) and safetensors payload files (payload.py,
files.py) written by a background writer (writer.py, writes.py; health.py turns
writes off on a failure and back on) and streamed back by reader threads
(stream.py, readers.py)."""

from .tier import SsdTier

__all__ = ["SsdTier"]
