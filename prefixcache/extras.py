"""Optional dependencies: imported when a feature needs them, or a clear error naming the extra.

The remote tier's client (redis, hiredis) is the ``prefixcache[remote]``
extra; the rest of the package imports without it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import ``module``, which ``feature`` needs and ``prefixcache[extra]`` installs.

    Raises:
        MissingExtraError: ``module`` is not installed; the message names the
            feature and the ``pip install`` line that fixes it.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.partition(".")[0]:
            raise  # installed, but something it imports is missing: not ours to explain
        raise MissingExtraError(
            f"{feature} needs the {module!r} package, which is not installed: "
            f"pip install 'prefixcache[{extra}]'",
            extra,
        ) from None
