"""The SSD tier's admin corner: a directory opened for inspection or maintenance.

The serving path (``tiers/ssd``: tier, index, payloads, readers, writes) never
imports this package; the ``prefixcache`` commands do. ``view``: the directory
opened without a writer (read-only by default); ``inventory``: what it holds,
per namespace and chain; ``maintenance``: ``verify`` and ``gc``.
"""
