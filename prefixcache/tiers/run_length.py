"""How many blocks a run file of the SSD tier holds: the writer's cut and its grouping agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..blocks import BlockHeader


class _Queued(Protocol):
    @property
    def block(self) -> BlockHeader: ...


Item = TypeVar("Item", bound=_Queued)  # a writer's queued block (writer.WriteItem)


@dataclass(frozen=True, slots=True)
class RunHints:
    """What the writer of run files needs to know of a namespace's layout.

    ``whole``: the payload-name prefixes of its layers whose K/V a restore takes
    from one block only (a window no longer than a block), kept whole per block.
    ``window_blocks``: the blocks its widest longer window needs at a chain's
    end, written in a run file of their own where a run joins the K/V of those
    longer windows' layers (``windows``: their prefixes; ``runfiles._split_end``).
    """

    whole: tuple[str, ...] = ()
    window_blocks: int = 0
    windows: tuple[str, ...] = ()


NO_HINTS = RunHints()


def run_blocks(index: int, block_tokens: int, run_tokens: int, growth: float = 0.0) -> int:
    """Blocks a run starting at chain block ``index`` holds at most: ``run_tokens``
    tokens, or ``growth`` times the tokens before it where that is more. Growing
    runs keep a long chain in few files, while a hit that ends inside a run
    reads at most ``growth`` times its own tokens more (the rest of that run)."""
    tokens = max(1, block_tokens)
    return max(1, max(run_tokens, int(growth * index * tokens)) // tokens)


def whole_runs(
    batch: list[Item], after: Item | None, run_tokens: int, growth: float = 0.0
) -> list[Item]:
    """``batch`` without the blocks of its last chain past its last whole run
    (``run_blocks`` from the chain's first block in it), where that chain goes on
    with ``after`` (None: may go on, a store still queuing); they are the next
    batch's first run. As is where the chain stops there or holds no whole run."""
    if after is not None and after.block.parent != batch[-1].block.key:
        return batch
    start = len(batch) - 1  # the chain's first block in the batch
    while start and batch[start].block.parent == batch[start - 1].block.key:
        start -= 1
    whole = at = start
    while at < len(batch):
        first = batch[at].block
        at += run_blocks(first.index, first.num_tokens, run_tokens, growth)
        if at <= len(batch):
            whole = at
    return batch[:whole] if whole > start else batch
