"""The tier contract: what every tier (hot, ssd, remote) answers, and what a tier may add.

A tier holds blocks under their chain keys. The stack asks its tiers in
order: ``held`` says how far a prompt's chain is held (one call for the whole
chain), a :class:`TierReader` loads the blocks of one restore (a lower tier's
reader may write them straight into the restore buffers), and ``put`` stores a
block (a lower tier may write it in the background). A new tier is one module
implementing :class:`Tier`; it joins the stack through one line in
``prefixcache.tiers.lower_tiers``, or is handed to ``PrefixCache(tiers=...)``.

What only some tiers do is a capability a tier opts into by deriving from it
too (``class SsdTier(ListsChildren, KeepsPins, ..., Tier)``); the stack asks
``isinstance``: :class:`ListsChildren` (tails and partial blocks),
:class:`KeepsPins` (pins held against the tier's own eviction),
:class:`Persistent` (a record that outlives the process: namespaces, counters,
the chains a warm start loads), :class:`Metered` (writes wear a local disk:
admission and a write budget), :class:`ReportsEvents` (the tier reports its
own stores and evictions) and :class:`CostGated` (fetching weighed against
recomputing, misses of its own kind).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..errors import MissReason
from .run_length import NO_HINTS, RunHints

if TYPE_CHECKING:
    import numpy as np

    from ..blocks import Block
    from ..memory.host import Place, Placed


class ChainEntry(Protocol):
    """What a chain walk needs of a stored block: a hot Block or an index BlockMeta."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    nbytes: int


class BlockListener(Protocol):
    """Hears blocks enter and leave a tier (e.g. the KV events publisher)."""

    def stored(self, tier: str, blocks: Sequence[ChainEntry]) -> None: ...

    def removed(self, tier: str, keys: Sequence[bytes]) -> None: ...


class Loaded(Protocol):
    """A block loaded for a restore: a Block, or one whose tensors are host views."""

    key: bytes
    parent: bytes
    root: bytes
    index: int
    tokens: bytes
    nbytes: int
    arrays: Mapping[str, object]

    def to_block(self) -> Block: ...


class TierReader(ABC):
    """Loads the blocks one restore needs from one tier, in the order of ``prepare``.

    Loaded arrays may be views valid only until the next ``load``; ``close``
    stops whatever ``prepare`` started and is called before the restore
    buffers are let go (nothing may write into them afterwards).
    """

    def first_shapes(self, indices: list[int]) -> Mapping[str, Placed] | None:
        """Dtypes and shapes of the tensors of block ``indices[0]``, if known before
        loading it (so the restore buffers exist before any read); else None."""
        return None

    def prepare(self, indices: list[int], place: Place | None) -> None:  # noqa: B027
        """Start loading blocks ``indices`` (in that order); ``place`` gives a
        tensor its destination in the restore buffers, when it has one."""

    @abstractmethod
    def load(self, index: int) -> Loaded | None:
        """Chain block ``index`` with its payload, or None when it is unusable."""

    def load_run(self, index: int, limit: int | None = None) -> list[Loaded | None]:
        """Block ``index`` (as ``load``) and the blocks after it in the order of
        ``prepare`` that are ready with it, at most ``limit`` in all: consecutive
        chain indices, each loaded or None. A tier that reads several blocks as
        one unit hands them over at once; by default one block."""
        return [self.load(index)]

    def miss(self, index: int) -> MissReason:
        """Why block ``index`` could not be loaded (``load`` gave None): a damaged
        block unless the tier knows better (the hot tier: evicted meanwhile)."""
        return MissReason.CORRUPT

    def host_views(self, index: int) -> Mapping[str, np.ndarray] | None:
        """Host bytes of block ``index``'s 4-axis arrays when the tier holds them in
        memory for good (the hot tier: a restore copies them in one go); else None."""
        return None

    def close(self) -> None:  # noqa: B027
        """Stop loading; safe to call more than once."""


class Tier(ABC):
    """One tier of blocks.

    Attributes:
        name: ``hot``, ``ssd`` or ``remote``: the key of its stats and counters.
        resident: loaded blocks stay in memory (no copy is needed to keep them).
        eager: takes every stored block at once, whatever the write policy
            (else blocks arrive on spill, or at once under ``write_through``).
    """

    name: ClassVar[str]
    resident: ClassVar[bool] = False
    eager: ClassVar[bool] = False

    @abstractmethod
    def entry(self, key: bytes) -> ChainEntry | None:
        """The metadata of block ``key`` if the tier holds it (no payload is read)."""

    def held(self, keys: Sequence[bytes], start: int) -> list[ChainEntry]:
        """Entries of ``keys[start:]``, consecutive from ``start``, while this tier
        holds them. A tier with a round-trip cost answers it in one batch."""
        out = []
        for key in keys[start:]:
            found = self.entry(key)
            if found is None:
                break
            out.append(found)
        return out

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the tier holds (or is about to hold) ``key``."""

    @abstractmethod
    def reader(self, keys: Sequence[bytes]) -> TierReader:
        """A reader for one restore of chain ``keys``."""

    @abstractmethod
    def put(self, block: Block) -> bool:
        """Keep ``block`` (arrays evaluated); False when it was dropped."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop these blocks; returns how many were held."""

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027
        """Mark blocks (root-first) as just used."""

    def flush(self) -> None:  # noqa: B027
        """Wait until every accepted ``put`` is stored."""

    def close(self) -> None:  # noqa: B027
        """Flush and release; re-raises a background failure once."""

    def payload_names(self, key: bytes) -> Container[str] | None:
        """The flat payload names block ``key`` holds, if known without reading its
        payload (a restore plan skips blocks lacking a layer's part); None: unknown."""
        return None

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Gauges and counters of the tier (flat, numeric)."""


class ListsChildren(ABC):
    """A tier that lists what it holds under a parent: full blocks and tails alike,
    for partial-block reuse. Tails are found only that way, so the stack puts
    them only to tiers of this kind (``class MyTier(ListsChildren, Tier)``)."""

    @abstractmethod
    def children(self, parent: bytes, near: bytes | None = None) -> Sequence[ChainEntry]:
        """Entries held under ``parent`` (a block key or a root key). With ``near``
        (the token bytes that follow ``parent`` in a prompt) a tier may list only
        the entries nearest to it: at least those sharing the most leading tokens
        with it (the remote tier, whose lists grow with every host's traffic)."""


class KeepsPins(ABC):
    """A tier that holds pinned blocks against its own eviction and keeps the pins
    (the SSD tier: in its index, so they survive a restart)."""

    @abstractmethod
    def check_pin(self, blocks: Sequence[Block]) -> None:
        """Raise PinCapacityError if pinning ``blocks`` too would exceed the cap."""

    @abstractmethod
    def pin(self, blocks: Sequence[Block], until: float) -> None:
        """Never evict these blocks until ``until`` (Unix time, inf: never)."""

    @abstractmethod
    def unpin(self, keys: Sequence[bytes]) -> None:
        """End the pins of ``keys`` (the blocks stay, evictable again)."""

    @abstractmethod
    def pins(self) -> Mapping[bytes, float]:
        """Pins the tier keeps: key -> end (Unix time)."""


class Persistent(ABC):
    """A tier whose blocks outlive the process: it records what they stand for and
    the caches' counters, and names the blocks a warm start loads first."""

    @abstractmethod
    def note_namespace(self, root: bytes, namespace_json: str, runs: RunHints = NO_HINTS) -> None:
        """Record which model and layout ``root`` stands for (for inspection). ``runs``:
        what a tier joining blocks' K/V (the SSD tier's run files) needs to know of
        the layout (``run_length.RunHints``)."""

    @abstractmethod
    def save_counters(self, root: bytes, delta: Mapping[str, object]) -> None:
        """Add a cache's counters since its last save to the tier's own record."""

    def namespaces(self) -> Mapping[bytes, str]:
        """Root key -> namespace JSON of the namespaces the tier recorded, where it
        reads them cheaply (``explain`` looks for a prompt under the others); else {}."""
        return {}

    def recent(self, max_bytes: int) -> Sequence[ChainEntry]:
        """Blocks to load into hot first after a restart (warm start): pinned chains,
        then the most recently used ones, each root-first, up to ``max_bytes``."""
        return []


class Metered(ABC):
    """A tier whose writes wear a local disk: the stack applies ``ssd_admit_after``
    and the tier's write budget before each put (governor.py)."""

    @abstractmethod
    def write_budget_left(self) -> int | None:
        """Bytes the tier may still write now under its write budget; None: no budget."""


class ReportsEvents(ABC):
    """A tier that reports the blocks it stores and removes itself (from its writer
    thread, with its own evictions); for the others the stack reports each
    accepted ``put`` and each ``remove``."""

    @abstractmethod
    def watch(self, listener: BlockListener) -> None:
        """Report blocks stored and removed to ``listener`` from now on."""


class CostGated(ABC):
    """A tier behind a round trip (remote): it weighs fetching a prefix against
    recomputing it, and may miss for reasons of its own (unreachable, too slow)."""

    @abstractmethod
    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """Hear how fast the model prefilled (to weigh fetching against it)."""

    @abstractmethod
    def miss_reason(self, key: bytes) -> MissReason | None:
        """Why the last ``held`` stopped at ``key`` if not because the tier lacks
        it (e.g. the server was unreachable); else None."""


class SharesTenants(ABC):
    """A lower tier that charges each block to its tenant (``Block.tenant``) and keeps
    each tenant's figures: the ``stats()["tenants"][name][tier]`` of docs/stats.md."""

    @abstractmethod
    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Each tenant's figures on this tier: nbytes, num_blocks, floor_bytes,
        cap_bytes (-1: none) and the counters of ``tiers/hot/tenants.COUNTERS``."""

    @property
    def charges_tenants(self) -> bool:
        """Whether this tier keeps tenants' figures as configured (the remote tier:
        only with remote floors or caps); else ``stats()`` lists none of it."""
        return True
