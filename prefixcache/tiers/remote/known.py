"""The blocks this host knows the remote server holds (it wrote them), so that
``contains`` and ``put`` ask no server: bounded, oldest forgotten first.

Under tenant shares another write may evict a block (shares.py): the evicted
come back as names (with ``remote_secret``, keyed hashes of the keys), so
the blocks are also kept by name, and forgetting them lets a later ``put``
write them again. Not thread-safe: the tier's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

KNOWN = 65536  # keys remembered


class Known:
    """Keys written to the server, the oldest forgotten past ``limit``.

    Args:
        name: a key's name on the server, when blocks are forgotten by name
            (tenant shares); None: never.
    """

    def __init__(self, name: Callable[[bytes], bytes] | None = None, limit: int = KNOWN):
        self.limit, self._name = limit, name
        self._keys: OrderedDict[bytes, bytes | None] = OrderedDict()  # key -> its name
        self._by_name: dict[bytes, bytes] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        name = self._name(key) if self._name is not None else None
        self._keys[key] = name
        if name is not None:
            self._by_name[name] = key
        while len(self._keys) > self.limit:
            self._drop(*self._keys.popitem(last=False))

    def forget(self, key: bytes) -> bool:
        """Forget ``key``; whether it was known."""
        if key not in self._keys:
            return False
        self._drop(key, self._keys.pop(key))
        return True

    def forget_names(self, names: Iterable[bytes]) -> None:
        for name in names:
            key = self._by_name.get(name)
            if key is not None:
                self.forget(key)

    def _drop(self, key: bytes, name: bytes | None) -> None:
        if name is not None:
            self._by_name.pop(name, None)
