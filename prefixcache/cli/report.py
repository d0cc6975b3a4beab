"""Human output of the inspection CLI: sizes, ages, durations, aligned tables, trees."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..tiers.ssd.inventory import Segment

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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
        if seconds >= _SECONDS[unit]:
            major, rest = divmod(seconds, _SECONDS[unit])
            minor = rest // _SECONDS[units[i + 1]]
            return f"{major}{unit} {minor}{units[i + 1]}" if minor else f"{major}{unit}"
    return f"{seconds}s"


def parse_duration(text: str) -> float:
    """Seconds in ``7d``, ``12h``, ``1h30m``, ``90s``, ``2w`` or a bare number of seconds.

    Raises:
        ValueError: not a duration.
    """
    raw = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", raw):
        return float(raw)
    pos, total = 0, 0.0
    for match in _DURATION.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or not raw:
        raise ValueError(f"not a duration (e.g. 7d, 12h, 30m): {text!r}")
    return total


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
