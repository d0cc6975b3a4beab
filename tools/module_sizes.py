"""The module size rule: 300 lines is the target, a module over 400 lines fails.

One concept per module (STYLE): a module that grows past the target holds two
concepts and is split where they part, never squeezed. Run from the repository
root, ``python tools/module_sizes.py`` lists the modules of prefixcache/ and
tools/ over the target and exits 1 when one is over the limit.
"""

from __future__ import annotations

import sys
from pathlib import Path

TARGET_LINES = 300
MAX_LINES = 400
ROOTS = ("prefixcache", "tools")


def module_lines(*roots: Path) -> dict[Path, int]:
    """Lines of every ``*.py`` file under ``roots``, by path."""
    return {
        path: len(path.read_text().splitlines())
        for root in roots
        for path in sorted(root.rglob("*.py"))
    }


def over(sizes: dict[Path, int], limit: int) -> dict[Path, int]:
    """The modules of ``sizes`` with more than ``limit`` lines."""
    return {path: n for path, n in sizes.items() if n > limit}


def main(argv: list[str] | None = None) -> int:
    roots = [Path(r) for r in (argv if argv is not None else sys.argv[1:]) or ROOTS]
    sizes = module_lines(*roots)
    for path, n in over(sizes, TARGET_LINES).items():
        verdict = "over the limit" if n > MAX_LINES else "over the target"
        print(f"{path}: {n} lines, {verdict} ({TARGET_LINES} target, {MAX_LINES} fails)")
    return 1 if over(sizes, MAX_LINES) else 0


if __name__ == "__main__":
    sys.exit(main())
