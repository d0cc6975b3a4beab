"""The codec contract: how one cache class is cut into blocks and rebuilt.

A codec handles one layer's cache object. The cache cuts every full block of
a live cache with ``cut`` (during prefill, after each chunk, and when a
finished cache is handed back) and, on a hit, rebuilds a fresh layer cache with
a ``Builder`` fed block by block (hot blocks, or a lower tier's payloads
streamed one at a time), in chain order.

Not every payload can be cut at any time: a sliding window only holds its last
tokens and a recurrent state exists only at the boundary where the cache
stands. So ``cut`` may return nothing for a layer, a stored block may lack some
layers' payloads, and a codec says which blocks it needs (``blocks_needed``)
and which needed block's stored payload cannot serve it (``missing``), judged
before a restore copies anything.

The built-in payloads per block:

=====================  ==============================================================
cache class            payload per block
=====================  ==============================================================
KVCache                ``keys``, ``values``: the block's slice of the token axis
QuantizedKVCache       ``keys.q|scales|biases``, ``values.*``: packed, never dequantized
RotatingKVCache        ``keys``, ``values`` while in the window (``keep.*``: first tokens)
ChunkedKVCache         ``keys``, ``values`` while in the current chunk
ArraysCache            ``0``, ``1``, ...: state snapshot at the block's end boundary
CacheList              each part's payload under ``"{part}."``
LayerCache             ``c.*``: compressed rows; ``w.*``: window and open-group rows
UnusedKVCache          nothing: a layer the model never writes (no-op attention)
=====================  ==============================================================

A cache class of another package (a TurboQuant-style quantized cache, say)
plugs in by subclassing :class:`Codec` and calling ``register_codec`` before a
``PrefixCache`` is built for a model that uses it::

    from prefixcache.codecs import Builder, Codec, register_codec


    class MyCodec(Codec):
        cache_type = MyCache                       # looked up by exact class
        def layout(self, cache): ...               # namespace signature (hashable, JSON-able)
        def length(self, cache): return cache.offset
        def cut(self, cache, start, end, *, length, snapshot=True):
            return {"q": ..., "scales": ...}       # new arrays of tokens [start, end)
        def builder(self, fresh, num_tokens, capacity, block_size): return MyBuilder(...)

    register_codec(MyCodec())

A :class:`Builder` receives each needed block's payload in chain order
(``add``), exposes the arrays to evaluate after each block (``buffers``) and
returns the rebuilt cache (``finish``); it must give the cache new arrays,
never the payload's own objects. Optional hooks, each with its default here:
``blocks_needed`` (a window needs only its last blocks), ``missing``,
``trimmable_at``, ``window`` (payloads kept only around restore points) and
``reach`` (blocks that may gain a payload from a later capture). Lookup is by
exact class: a subclass of a built-in cache needs its own codec. A cache class
with no codec is refused with ``UnsupportedCacheError`` when the
``PrefixCache`` is built. The ``layout`` of a cache is part of the hash
namespace, so blocks of one codec's layout are never served to another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from ..errors import LayoutMismatchError, MissReason, Shortfall
from ..memory.copies import Copies

STEP = 256  # mlx-lm's KV buffer growth step

Has = Callable[[str], bool]  # is a payload name (without the layer prefix) stored?
# a block held in memory: its payload, and the host bytes of its 4-axis arrays
Resident = tuple[Mapping[str, mx.array], Mapping[str, np.ndarray]]
Payload = Callable[[int], "Has | None"]  # chain index -> its stored names; None: unknown


def round_up(n: int, step: int = STEP) -> int:
    return -(-n // step) * step


def owned(x: mx.array) -> mx.array:
    """A row-contiguous copy of ``x`` sharing no memory with it.

    ``mx.array`` copies but keeps a transposed layout (a ring filled straight
    from the attention's K/V is one), which payload files cannot hold;
    ``mx.contiguous`` returns the array itself when it is row-contiguous.
    """
    return mx.array(mx.contiguous(x))


def owned_tokens(x: mx.array, start: int, end: int) -> mx.array:
    """A row-contiguous copy of tokens ``[start, end)`` of ``x`` (B, heads, T, dim),
    sharing no memory with it: one copy, decided from the shapes (no evaluation).

    Several heads and a slice of 2 to T - 1 tokens are never row-contiguous, whatever
    the buffer's layout: ``mx.contiguous`` copies them. A single head, a single
    token or the whole buffer may be contiguous already (a view): copied once more.
    """
    part = x[..., start:end, :]
    if x.shape[1] > 1 and 1 < end - start < x.shape[2]:
        return mx.contiguous(part)
    return owned(part)


def run_shape(shape: tuple[int, ...], count: int, block_size: int) -> tuple[int, ...] | None:
    """The shape of ``count`` blocks' tensors of ``shape`` one after another on the
    token axis (axis 2); None unless they are full blocks (or just one)."""
    if count == 1:
        return shape
    if len(shape) != 4 or shape[2] != block_size:
        return None
    return (shape[0], shape[1], count * block_size, shape[3])


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (the last one possibly in part)."""
    return -(-num_tokens // block_size)


class Builder(ABC):
    """Rebuilds one layer cache from block payloads fed in chain order.

    Attributes:
        takes_host: ``add`` accepts HostArray / Placed tensors as the SSD stream
            gives them (copied or already in place); else it gets MLX arrays.
        placed_checks_only: ``add`` of tensors all ``Placed`` (each where this
            builder's ``destination`` put it) only checks which names the
            payload has: a later block with the same names needs no ``add``.
        whole_tensors: ``reserve`` sizes each buffer as a tensor itself (a state
            snapshot), so an unverified header's tensors of any shape may size
            them (the file holds their bytes); else (buffers of ``capacity``
            tokens) only a header's tensors of the block's own token count do.
    """

    takes_host: ClassVar[bool] = False
    placed_checks_only: ClassVar[bool] = False
    whole_tensors: ClassVar[bool] = False

    @abstractmethod
    def add(self, index: int, arrays: dict[str, Any]) -> None:
        """Copy block ``index``'s payload for this layer into the cache.

        Raises:
            LayoutMismatchError: the payload is missing or unusable (its
                ``reason`` is recorded and the restore is shortened).
        """

    @abstractmethod
    def buffers(self) -> list[mx.array]:
        """Arrays to evaluate after each block, so blocks stream through."""

    @abstractmethod
    def finish(self) -> Any:
        """Return the rebuilt layer cache."""

    def add_resident(self, indices: Sequence[int], blocks: Sequence[Resident], prefix: str) -> bool:
        """Take several blocks held in memory at once (the hot tier's, in chain
        order): each a payload and the host bytes of its arrays, this builder's
        names under ``prefix``. Returns False, taking nothing, where it
        cannot (then each block comes through ``add``). A fast path: one copy per
        buffer."""
        return False

    def add_each(self, indices: Sequence[int], payloads: Sequence[dict[str, Any]]) -> None:
        """``add`` each block in turn.

        Raises:
            Shortfall: a block's payload is unusable (the restore is shortened).
        """
        for index, arrays in zip(indices, payloads, strict=True):
            try:
                self.add(index, arrays)
            except (LayoutMismatchError, KeyError) as err:
                raise Shortfall.of(index, err) from err

    def queue_copies(self, copies: Copies) -> None:
        """Open the buffers of the blocks held in memory (after ``allocate`` was
        evaluated) and hand their copies to ``copies``, which runs them, perhaps
        on other threads; ``finish`` once it has waited. Builders that copy in
        ``finish`` hand nothing."""
        return None

    def allocate(self) -> list[mx.array]:
        """The buffers still to allocate for the blocks added so far, lazily: the
        restore evaluates every builder's together (one evaluation, not one per
        buffer: each wakes MLX's stream thread, ~0.1 ms on a CPU). [] for none."""
        return []

    def reserve(self, index: int, arrays: Mapping[str, Any]) -> list[mx.array]:
        """Allocate (unwritten) the buffers block ``index``'s streamed tensors go into,
        given the tensors or their dtypes and shapes (``Placed``). Returns what to
        evaluate (the restore evaluates every builder's at once, then ``buffers``
        opens them for ``destination``); [] when this builder allocates nothing ahead."""
        return []

    def destination(
        self, index: int, name: str, dtype: mx.Dtype, shape: tuple[int, ...], count: int = 1
    ) -> np.ndarray | None:
        """Where a reader thread may write tensor ``name`` of block ``index`` (with
        ``count`` > 1: of the ``count`` full blocks from ``index``, one after another
        on the token axis): its region of a restore buffer (see ``host.Place``), or
        None. Runs no MLX."""
        return None


class Codec(ABC):
    """Cuts one cache class into block payloads and rebuilds it.

    Attributes:
        cache_type: the mlx-lm (or third-party) cache class handled.
        cuts_runs: whether blocks cut together may be views of one run's arrays
            (memory/runs.py): every payload is a 4-axis slice of the token axis
            whose ``cut`` over many blocks is theirs one after another, and the
            builder's ``add_resident`` skips the empty views of a run's blocks
            after the first. False (the default): each block owns its arrays.
    """

    cache_type: ClassVar[type]
    cuts_runs: ClassVar[bool] = False

    @abstractmethod
    def layout(self, cache: Any) -> tuple[object, ...]:
        """Layer signature for the namespace, from a cache holding >= 1 token."""

    @abstractmethod
    def length(self, cache: Any) -> int | None:
        """Tokens the cache holds, or None when the cache does not track it."""

    def trimmable_at(self, fresh: Any, num_tokens: int) -> bool:
        """Whether this layer can be rebuilt holding exactly ``num_tokens`` tokens.

        A fully cached prompt is restored one token short when every layer
        allows it; else one block short.
        """
        return bool(fresh.is_trimmable())

    def window(self, cache: Any) -> tuple[str, int, int] | None:
        """Payloads only a window of the cache's last tokens gives: (their name prefix
        within this layer's, the tokens before its end a restore needs, the tokens it
        keeps at the front). None (the default): every payload can be cut at any time.
        The window policy (``cache/window.py``) keeps them only around restore points."""
        return None

    def reach(self, cache: Any, length: int) -> int:
        """First token whose block may gain a payload from ``cache`` now.

        A block stored earlier may lack this layer's payload (a window since
        overwritten, a boundary without a snapshot); blocks from ``reach`` on
        are re-cut to fill such gaps. ``length`` (the default) means never.
        """
        return length

    @abstractmethod
    def cut(
        self, cache: Any, start: int, end: int, *, length: int, snapshot: bool = True
    ) -> dict[str, mx.array]:
        """Payload of tokens ``[start, end)`` as new arrays (not evaluated).

        Args:
            cache: the live layer cache.
            start, end: the block's token range.
            length: tokens the cache holds now (a recurrent cache does not know).
            snapshot: whether a boundary-state codec keeps a snapshot here.

        Returns:
            Arrays owned by the payload (never views of the live cache); empty
            when the cache no longer holds (or never held) what the block needs.
        """

    def blocks_needed(self, fresh: Any, num_tokens: int, block_size: int) -> Sequence[int]:
        """Chain indices whose payload this layer needs to hold ``num_tokens`` tokens."""
        return range(num_blocks(num_tokens, block_size))

    def missing(
        self, fresh: Any, num_tokens: int, block_size: int, payload: Payload
    ) -> tuple[int, MissReason] | None:
        """A needed block whose stored payload cannot serve this layer, and why; None
        when every needed block can (or is not known: the rebuild then checks).

        Called before a restore copies anything; ``payload(index)`` tells which of
        this layer's payload names block ``index`` holds. A codec whose ``cut``
        always gives a payload (KV, quantized) keeps this default: nothing to
        check, and its builder's ``add`` raising LayoutMismatchError is the backstop.
        """
        return None

    @abstractmethod
    def builder(self, fresh: Any, num_tokens: int, capacity: int, block_size: int) -> Builder:
        """A builder filling ``fresh`` (an empty cache from make_prompt_cache).

        Args:
            fresh: empty layer cache of the right class and settings.
            num_tokens: tokens the rebuilt cache will hold.
            capacity: buffer length in tokens (>= num_tokens).
            block_size: tokens per block.
        """
