"""Operator controls of one PrefixCache: pins, sessions, per-request persistence.

Each acts on every tier through the stack and the tier contract's
capabilities, so every tier obeys one decision:

- **Pins** (``pin``): a chain's blocks are made resident in hot (loaded from a
  lower tier if needed), written to the lower tiers that lack them, and
  pinned everywhere: ``Pins`` holds them in hot, each lower tier's ``pin`` in
  its own store (the SSD index: they survive a restart). Refused as a whole,
  before anything changes, when a tier's pinned bytes would pass its cap.
- **Sessions** (``stored`` / ``end``): a store with a session tags the blocks
  it created; a later store of another session (or of none) walking a tagged
  block shares it (the tag goes). ``end`` drops the blocks still tagged from
  every tier at once; pinned ones stay. Tags live in this process.
- **Persistence** (``publish``): a ``persist=True`` store walking blocks that
  a ``persist=False`` store kept hot-only makes them ordinary blocks (its own
  prompt holds them, so they are not private to the other request).

Not thread-safe: the facade's lock is held around every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..blocks import Block
from ..errors import PinCapacityError
from ..hashing import TOKEN_BYTES, tail_key
from .base import KeepsPins, Metered
from .losses import SESSION_ENDED
from .stack import TierStack


def check_session(session: str | None) -> str | None:
    """``session`` if it is None or a non-empty str; else TypeError/ValueError naming it."""
    if session is None:
        return None
    if not isinstance(session, str):
        raise TypeError(f"session must be a str, got {session!r}")
    if not session or len(session) > 256:
        raise ValueError(f"session must be 1 to 256 characters, got {session!r}")
    return session


class Controls:
    """Pins, sessions and persistence over one cache's tiers."""

    def __init__(self, tiers: TierStack) -> None:
        self.tiers = tiers
        self._owner: dict[bytes, str] = {}  # block key -> the only session holding it
        self._held: dict[str, set[bytes]] = {}  # session -> its blocks
        self._prune_at = 1024
        for tier in tiers.lower:  # pins recorded before a restart hold in hot too
            for key, until in tier.pins().items() if isinstance(tier, KeepsPins) else ():
                tiers.pins.add([key], until)

    # -- pins -----------------------------------------------------------------

    def pin(self, keys: Sequence[bytes], until: float) -> list[Block]:
        """Pin the held blocks of ``keys`` (a chain, root-first, then maybe a tail).

        Returns the blocks pinned (the held prefix of ``keys``).

        Raises:
            PinCapacityError: a tier's pinned bytes would pass its cap.
        """
        tiers = self.tiers
        blocks = self._resident(keys)
        pins, hot = tiers.pins, tiers.hot
        new = sum(b.nbytes for b in blocks if not pins.holds(b.key))
        held = hot.pinned_nbytes()
        if held + new > hot.max_bytes:
            raise PinCapacityError(
                f"pinning {len(blocks)} blocks would hold {held + new} pinned bytes in the "
                f"hot tier, over hot_max_bytes={hot.max_bytes} ({held} pinned already)"
            )
        lasting = [b for b in blocks if b.key not in tiers.private]
        keeping = [t for t in tiers.lower if isinstance(t, KeepsPins)]
        for tier in keeping:
            tier.check_pin([b for b in lasting if tiers.finds(tier, b)])
        for block in blocks:  # root-first: each one's parent is hot before it
            hot.put(block, at_cold_end=block.parent != block.root and block.parent not in hot)
        pins.add([b.key for b in blocks], until)
        for tier in tiers.lower:
            mine = [b for b in lasting if tiers.finds(tier, b)]
            for block in mine:
                if not tier.contains(block.key):
                    tiers.governor.put(tier, block, last_chance=False)
            if isinstance(tier, KeepsPins):
                tier.pin(mine, until)
        for block in lasting:
            if all(t.contains(block.key) for t in tiers.spill_to if tiers.finds(t, block)):
                hot.mark_clean(block.key)
        return blocks

    def unpin(self, keys: Sequence[bytes]) -> int:
        """End the pins of ``keys`` in every tier; how many were pinned here."""
        num = self.tiers.pins.remove(keys)
        for tier in self.tiers.lower:
            if isinstance(tier, KeepsPins):
                tier.unpin(keys)
        return num

    def _resident(self, keys: Sequence[bytes]) -> list[Block]:
        """The blocks of ``keys`` held by some tier, consecutive from the first, as
        hot Blocks (a lower tier's are loaded, not inserted yet)."""
        tiers, out = self.tiers, []
        for i, key in enumerate(keys):
            block = tiers.hot.get(key)
            if block is None:
                tier = next((t for t in tiers.lower if t.contains(key)), None)
                loaded = tier.reader(keys).load(i) if tier is not None else None
                block = loaded.to_block() if loaded is not None else None
            if block is None:
                break
            out.append(block)
        return out

    # -- sessions and persistence ------------------------------------------------

    def stored(
        self, session: str | None, persist: bool, blocks: Sequence[Block], walked: Sequence[bytes]
    ) -> None:
        """A store by ``session`` kept ``blocks`` new and went through ``walked`` (its
        chain keys and tail key); ``persist``: it may write them below hot."""
        if persist:
            self.publish(walked)
        new = {b.key for b in blocks}
        for key in walked:
            owner = self._owner.get(key)
            if owner is not None and owner != session and key not in new:
                del self._owner[key]
                self._held[owner].discard(key)
        if session is None:
            return
        held = self._held.setdefault(session, set())
        for key in new:
            self._owner[key] = session
            held.add(key)
        if len(self._owner) > self._prune_at:
            self._prune()

    def begin(self, session: str) -> None:
        """``session`` is known from now (``end`` accepts it before any store)."""
        self._held.setdefault(session, set())

    def end(self, session: str) -> int:
        """Drop the blocks only ``session`` holds from every tier; how many.

        Raises:
            ValueError: no store used ``session`` (or it has ended already).
        """
        if check_session(session) not in self._held:
            raise ValueError(f"unknown session {session!r}: no store used it, or it ended")
        keys = self._held.pop(session)
        for key in keys:
            self._owner.pop(key, None)
        tiers = self.tiers
        drop = [k for k in keys if not tiers.pins.holds(k)]  # a pin outlives its session
        present = [k for k in drop if tiers.contains(k)]
        tiers.remove_lower(drop)
        tiers.hot.remove(drop)
        tiers.private.difference_update(drop)
        listener = tiers.governor.listener
        for name in tiers.governor.reported if listener is not None else ():
            listener.removed(name, drop)  # tiers that do not report their own removals
        tiers.losses.lost(tiers.all[-1].name, present, SESSION_ENDED)  # from every tier
        return len(present)

    def stats(self) -> dict[str, int]:
        return {"num_pinned": len(self.tiers.pins.live()), "num_sessions": len(self._held)}

    def used(self, keys: Sequence[bytes]) -> None:
        """A fetch restored ``keys``: one more sighting each; under ``write_through``
        a deferred block admitted now is written at once."""
        tiers = self.tiers
        for key in keys:
            tiers.governor.seen(key)
        if tiers.governor.admit_after <= 1:
            return
        for key in keys:
            block = tiers.hot.get(key) if key not in tiers.private else None
            for tier in tiers.on_store if block is not None else ():
                due = isinstance(tier, Metered) and tiers.finds(tier, block)
                due = due and not tier.contains(key)
                if due and tiers.governor.admitted(key):
                    tiers.governor.put(tier, block, last_chance=False)

    def publish(self, walked: Iterable[bytes]) -> None:
        """Blocks a persist=False store kept hot-only that a persist=True store walked
        become ordinary blocks: dirty in hot, written through where due."""
        tiers = self.tiers
        for key in walked:
            block = tiers.hot.get(key) if key in tiers.private else None
            if block is None:
                continue
            tiers.private.discard(key)
            waits = False
            for tier in tiers.on_store:
                if tiers.finds(tier, block):
                    waits = tiers.governor.put(tier, block, last_chance=False) is None or waits
            if tiers.on_spill or waits:
                tiers.hot.mark_dirty(key)

    def _prune(self) -> None:
        """Forget tags of blocks no tier holds any more (evicted meanwhile)."""
        gone = [k for k in self._owner if not self.tiers.contains(k)]
        for key in gone:
            self._held[self._owner.pop(key)].discard(key)
        self._prune_at = max(1024, 2 * len(self._owner))


def tail_keys(root: bytes, keys: Sequence[bytes], data: bytes, block_size: int) -> list[bytes]:
    """The tail key of ``data`` (uint32 token bytes) after its full blocks ``keys``, if any."""
    rest = data[len(keys) * block_size * TOKEN_BYTES :]
    return [tail_key(keys[-1] if keys else root, rest)] if rest else []
