"""Human output of the inspection CLI: sizes, ages, aligned tables, trees."""

from __future__ import annotations

from collections.abc import Sequence

from ..tiers.ssd.admin.inventory import Segment
from .common import SECONDS

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units; bytes are exact)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(n)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def format_age(seconds: float) -> str:
    """``93784`` -> ``1d 2h``: the two largest units."""
    seconds = max(0, int(seconds))
    units = ("w", "d", "h", "m", "s")
    for i, unit in enumerate(units[:-1]):
        if seconds >= SECONDS[unit]:
            major, rest = divmod(seconds, SECONDS[unit])
            minor = rest // SECONDS[units[i + 1]]
            return f"{major}{unit} {minor}{units[i + 1]}" if minor else f"{major}{unit}"
    return f"{seconds}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str) -> str:
    """Columns padded to their widest cell; ``align`` has one ``l`` or ``r`` per column."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def short(key: bytes) -> str:
    """First 12 hex digits: enough to name a block to ``show``."""
    return key.hex()[:12]


def tree_lines(segments: list[Segment], prefix: str = "") -> list[str]:
    """Draw segments as a tree; a node with several children is a fork."""
    lines: list[str] = []
    todo = [(seg, prefix, i == len(segments) - 1) for i, seg in enumerate(segments)][::-1]
    while todo:
        seg, pre, last = todo.pop()
        branch, below = ("└─ ", "   ") if last else ("├─ ", "│  ")
        lines.append(pre + branch + _node(seg))
        kids = seg.children
        todo += [(kid, pre + below, i == len(kids) - 1) for i, kid in enumerate(kids)][::-1]
    return lines


def _node(seg: Segment) -> str:
    num = len(seg.keys)
    keys = short(seg.keys[0]) if num == 1 else f"{short(seg.keys[0])}..{short(seg.keys[-1])}"
    blocks = "1 block" if num == 1 else f"{num} blocks"
    fork = f"  fork: {len(seg.children)} ways" if len(seg.children) > 1 else ""
    return (
        f"tokens {seg.start_token}-{seg.end_token}  {blocks}  {format_bytes(seg.nbytes)}"
        f"  {keys}{fork}"
    )
