"""Lower-tier blocks handed to the builders as their tiers load them, in chain order.

A tier that reads several blocks as one unit (the SSD tier: a run file's
blocks) hands them over at once (``TierReader.load_run``), so the restore's
work is per unit, not per block: blocks read wholly into place, in one run
region, for the same layers, need the checks of the first alone. Any other
block is split by layer and added to each layer's builder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import mlx.core as mx

from ..blocks import split_layers
from ..codecs import Builder
from ..errors import LayoutMismatchError, Shortfall
from ..memory.host import HostArray, Placed, PlacedRun
from ..memory.restore_buffers import batched

Checked = tuple[frozenset[str], tuple[int, ...]]  # a placed block's names and layers


class Loader(Protocol):
    """What hands over the plan's blocks (``restore.ChainLoad``)."""

    def payloads(self, index: int, limit: int) -> tuple[list[Mapping[str, Any]], bool]: ...


def add_streamed(
    builders: list[Builder], users: dict[int, list[int]], order: list[int], loader: Loader
) -> None:
    """Hand blocks ``order`` to the builders as their tiers load them: a run the
    tier loads as one unit (a run file's blocks) is taken at once, and its blocks
    after the first, placed in the same run region for the same layers, need no
    more than the first's checks."""
    checked: set[Checked] = set()
    pos = end = 0
    while pos < len(order):
        if pos == end:  # a stretch of consecutive indices: a run can hold them
            end = pos + 1
            while end < len(order) and order[end] == order[end - 1] + 1:
                end += 1
        index = order[pos]
        payloads, resident = loader.payloads(index, end - pos)
        first, mine = payloads[0], users[index]
        only_checks = _add_block(builders, users, index, first, resident, checked)
        for i, arrays in enumerate(payloads[1:], index + 1):
            if not (only_checks and _same_run(arrays, first) and users[i] == mine):
                _add_block(builders, users, i, arrays, resident, checked)
        pos += len(payloads)


def _same_run(arrays: Mapping[str, Any], first: Mapping[str, Any]) -> bool:
    """Whether ``arrays`` and ``first`` are blocks of one run region (same names)."""
    return type(arrays) is PlacedRun and type(first) is PlacedRun and arrays.run is first.run


def _add_block(
    builders: list[Builder],
    users: dict[int, list[int]],
    index: int,
    arrays: Mapping[str, Any],
    resident: bool,
    checked: set[Checked],
) -> bool:
    """Hand block ``index``'s payload to the builders of the layers that use it. A
    block read wholly into place with an earlier one's names and layers (``checked``)
    needs nothing more where ``add`` only checks names (``placed_checks_only``).
    Whether the block needed only such checks."""
    mine = users[index]
    # a block read wholly into place by host-taking builders leaves no MLX work
    placed = type(arrays) is PlacedRun or all(type(a) is Placed for a in arrays.values())
    only_checks = placed and all(builders[i].placed_checks_only for i in mine)
    seen = (frozenset(arrays), tuple(mine)) if only_checks else None
    if seen in checked:
        return True
    layers = split_layers(arrays)
    streamed = not resident and not (placed and all(builders[i].takes_host for i in mine))
    if streamed:  # allocate every layer's buffer (unwritten) before the copies
        with batched(mx.cpu) as batch:
            lazy = [builders[i].reserve(index, layers.get(i, {})) for i in mine]
        mx.async_eval(lazy, batch.arrays)
    for layer in mine:
        builder, part = builders[layer], layers.get(layer, {})
        if not builder.takes_host:
            part = {
                n: a.to_mx() if isinstance(a, HostArray | Placed) else a for n, a in part.items()
            }
        try:
            builder.add(index, part)
        except (LayoutMismatchError, KeyError) as err:
            raise Shortfall.of(index, err) from err
    if streamed:
        mx.eval([b.buffers() for b in builders])
    if seen is not None:
        checked.add(seen)
    return seen is not None
