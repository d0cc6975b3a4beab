"""The ``prefixcache`` console script: MLX's backend checked before the CLI imports it.

On Linux, plain ``mlx`` has no backend (``mlx-cpu`` or ``mlx-cuda-*`` brings
one): importing ``mlx.core`` then fails deep inside the CLI's imports with a
missing ``libmlx.so``. Here that is one line naming the extras that install a
backend, exit 2, and every other start goes straight to :func:`prefixcache.cli.main`.
"""

from __future__ import annotations

import sys

BACKEND_EXTRAS = (
    "pip install 'prefixcache[cpu]' (Linux, CPU) or 'prefixcache[cuda]' (Linux, NVIDIA GPU); "
    "on macOS plain mlx has Metal"
)


def mlx_backend_error() -> str | None:
    """Why ``mlx.core`` cannot be imported (no backend installed), or None if it can."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as err:
        return f"MLX cannot be loaded ({err}): install a backend: {BACKEND_EXTRAS}"
    return None


def main() -> int:
    """Run the ``prefixcache`` command; a missing MLX backend is one line, exit 2."""
    problem = mlx_backend_error()
    if problem is not None:
        print(f"prefixcache: {problem}", file=sys.stderr)
        return 2
    from .cli import main as cli_main

    return cli_main()
