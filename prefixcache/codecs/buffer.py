"""TokenBuffer: one (B, heads, capacity, dim) buffer assembled from token-axis segments.

The buffer is allocated unwritten (``memory.restore_buffers.empty``; huge
pages where Linux gives them) and written only through a host view of its
memory, so its address never changes. Segments of blocks in memory (hot) are
queued and copied in together (one numpy call per run of consecutive
segments: memcpy speed, where MLX's concatenate on the CPU writes several
times slower into fresh small pages). Blocks streamed from a lower tier need
the buffer at once (``reserve``): the stream reads later blocks straight into
it (``destination``; they arrive as ``Placed``), and a HostArray is copied in
at once. The result is a single buffer of final length plus headroom that the
next prefill writes into in place. The headroom is left unwritten (on small
pages its fresh pages are not even faulted in): mlx-lm reads a cache only below its offset
(``update_and_fetch``, ``state``, a batch's ``merge``; ``to_quantized``
quantizes each token's row on its own), and each token's row is written
before the offset passes it.
"""

from __future__ import annotations

import operator
from functools import partial

import mlx.core as mx
import numpy as np

from ..errors import LayoutMismatchError
from ..memory.copies import Copies
from ..memory.host import HostArray, Placed, host_bytes, host_view
from ..memory.huge_pages import advise_huge
from ..memory.restore_buffers import SMALL, Slot, new_buffer, resolve


class TokenBuffer:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.array: mx.array | None = None
        # (first token, array, its host bytes if known): in-memory segments to copy
        self._pending: list[tuple[int, mx.array, np.ndarray | None]] = []
        # Byte view of ``array`` once it is written in place; set once, never reset
        # (reader threads hold destinations into it).
        self._host: np.ndarray | None = None
        # dtype and (B, heads, capacity, dim) of ``array``, set before ``_host``
        self._dtype: mx.Dtype | None = None
        self._dims = (0, 0, 0, 0)
        self._fresh: mx.array | Slot | None = None  # allocated ahead, not yet opened

    def add(self, start: int, x: mx.array | HostArray | Placed) -> None:
        """Queue ``x`` (B, heads, n, dim) for tokens ``[start, start + n)``.

        A HostArray is copied in at once (it is only valid until the next block);
        a Placed tensor is already in place.
        """
        if type(x) is Placed:  # the common case of a streamed restore: checks only
            if not self._fits(start, x.dtype, x.shape):
                raise LayoutMismatchError(f"placed tensor {x.dtype}{x.shape} is not in this buffer")
            return
        if isinstance(x, HostArray) or self._host is not None:
            self._write(start, x)
        else:
            self._pending.append((start, x, None))

    def add_run(self, segments: list[tuple[int, mx.array, np.ndarray]]) -> None:
        """Queue in-memory segments (first token, array, its host bytes) at once: the
        hot tier's blocks of a restore, copied in together by ``materialize``."""
        if self._host is not None:
            for start, x, _ in segments:
                self._write(start, x)
            return
        self._pending += segments

    def add_views(self, start: int, end: int, like: mx.array, views: list[np.ndarray]) -> None:
        """Queue consecutive hot segments' host bytes, filling tokens ``[start, end)``
        (``like``: the first one's array): one entry where ``add_run`` takes one per
        segment. numpy's copy checks that they fill exactly that span."""
        if not 0 <= start <= end <= self.capacity:
            raise LayoutMismatchError(f"tokens [{start}, {end}) outside {self.capacity}")
        self._pending.append((start, like, _Views(views, end)))  # an open buffer too

    def reserve(self, x: mx.array | HostArray | Placed | None) -> list[mx.array]:
        """Allocate (lazily) the buffer a first streamed ``x`` goes into, and write
        in place once ``materialize`` opens it: readers may then read later tensors
        straight into it.

        ``x`` is a HostArray or the dtype and shape of one (a ``Placed``). The
        memory is left unwritten (the blocks write their tokens once; the
        headroom stays unwritten). Returns the new buffer, for the caller to
        evaluate with others' (one wake of MLX's stream, not one per buffer);
        [] when there is nothing to allocate.
        """
        if not isinstance(x, HostArray | Placed) or self._host is not None or self._pending:
            return []
        if len(x.shape) != 4 or self._fresh is not None:
            return []  # _write reports a bad shape
        self._fresh = new_buffer((*x.shape[:2], self.capacity, x.shape[3]), x.dtype)
        return [] if type(self._fresh) is Slot else [self._fresh]  # a batch's: it returns it

    def destination(self, start: int, dtype: mx.Dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """Where a streamed tensor of ``dtype`` and ``shape`` for tokens from
        ``start`` goes: its region of the buffer (a ``Place`` region), or None
        when the buffer is not written in place yet or it does not fit.

        Safe from a reader thread: reads only the view, which never changes once set.
        """
        if not self._fits(start, dtype, shape):
            return None
        return self._host[:, :, start : start + shape[2], :]

    def allocate(self) -> list[mx.array]:
        """The buffer the queued segments will be copied into, created (lazily) for
        the caller to evaluate with others; [] if there is none to make (or it is
        small: ``finish`` builds it)."""
        if self._host is not None or self._fresh is not None or not self._pending:
            return []
        if self._small():
            return []
        x = self._pending[0][1]
        if len(x.shape) != 4:
            return []  # materialize reports it
        self._fresh = new_buffer((*x.shape[:2], self.capacity, x.shape[3]), x.dtype)
        return [] if type(self._fresh) is Slot else [self._fresh]  # a batch's: it returns it

    def materialize(self) -> mx.array | None:
        """Write the queued segments; returns the buffer or None if empty.

        Segments of blocks in memory are copied into a new, unwritten buffer
        (huge pages where Linux gives them) through its host view: one copy of
        every byte, at memcpy speed (MLX's concatenate writes into fresh small
        pages, several times slower on the CPU).
        """
        for run, first, end in self._open_runs():
            _copy_run(self._host, run, first, end)
        return self.array

    def queue_copies(self, copies: Copies) -> None:
        """Open the buffer and hand the queued segments' copies to ``copies``
        (checked here; they run numpy only, on any thread). ``finish`` once
        ``copies`` has waited for them."""
        if self._small():
            return  # ``finish`` copies it
        for run, first, end in self._open_runs():
            nbytes = (end - first) * (self._host.nbytes // self.capacity)  # bytes per token
            copies.add(nbytes, partial(_copy_run, self._host, run, first, end), len(run))

    def _open_runs(self) -> list[tuple[list[np.ndarray], int, int]]:
        """Open the buffer (reserved, or new for the queued segments) and take the
        queued segments as runs to copy: (host bytes in order, first token, end)."""
        if self._host is None and self._fresh is not None and not self._pending:
            fresh, self._fresh = self._fresh, None  # reserved: open it
            self._open(resolve(fresh))
        if not self._pending:
            return []
        if self._host is None:
            x = self._pending[0][1]
            if len(x.shape) != 4:
                raise LayoutMismatchError(f"block tensor has shape {x.shape}, expected 4 axes")
            fresh, self._fresh = resolve(self._fresh), None
            if fresh is None:
                fresh = new_buffer((*x.shape[:2], self.capacity, x.shape[3]), x.dtype)
            self._open(fresh)
        return self._runs()

    def _runs(self) -> list[tuple[list[np.ndarray], int, int]]:
        """The queued in-memory segments, checked, as runs of consecutive ones (one
        numpy call each: one for a whole chain)."""
        pending = sorted(self._pending, key=_first)  # queued in order: one pass
        self._pending.clear()
        runs: list[tuple[list[np.ndarray], int, int]] = []
        run: list[np.ndarray] = []
        first = end = 0
        dtype = self._dtype
        for start, x, view in pending:
            if run and start != end:
                runs.append((run, first, end))
                run = []
            if not run:
                first = start
            if type(view) is _Views:  # a run of hot segments (``add_views``)
                run += view.views
                end = view.end
                continue
            if view is None:  # a hot block's view comes checked: the tier holds one layout
                if x.dtype != dtype:
                    raise LayoutMismatchError(f"block tensor {x.dtype} does not fit {dtype}")
                if len(x.shape) != 4:
                    raise LayoutMismatchError(f"block tensor has shape {x.shape}, expected 4 axes")
                view = host_bytes(x)
            run.append(view)  # host bytes (B, heads, tokens, dim bytes): numpy's shape is cheap
            end = start + view.shape[2]
        if run:
            runs.append((run, first, end))
        for _, first, end in runs:
            if not 0 <= first <= end <= self.capacity:
                raise LayoutMismatchError(f"tokens [{first}, {end}) outside {self.capacity}")
        return runs

    def finish(self) -> mx.array | None:
        """The buffer; the tokens no block wrote (the headroom) are left unwritten."""
        if self._small():
            return self._build_small()
        return self.materialize()

    def _small(self) -> bool:
        """Whether the buffer is still to make, for queued in-memory segments only,
        and smaller than ``SMALL``: ``finish`` builds it in host memory."""
        if self._host is not None or self._fresh is not None or not self._pending:
            return False
        x = self._pending[0][1]
        if len(x.shape) != 4:
            return False  # _open_runs reports it
        b, h, _, d = x.shape
        return b * h * self.capacity * d * x.dtype.size < SMALL

    def _build_small(self) -> mx.array:
        """The queued segments copied into host memory, then into a new MLX array in
        one constructor copy: a small restore's cost is per call, and MLX's
        allocate-then-write (an evaluation per buffer batch, a host view) costs more
        than copying its few KiB twice. A dtype numpy lacks (bfloat16) is MLX's view
        of the bytes, evaluated with the restored cache."""
        x = self._pending[0][1]
        b, h, _, d = x.shape
        self._dtype, self._dims = x.dtype, (b, h, self.capacity, d)
        host = np.empty((b, h, self.capacity, d * x.dtype.size), np.uint8)  # headroom unwritten
        for run, first, end in self._runs():
            _copy_run(host, run, first, end)
        typed = _NUMPY_DTYPES.get(x.dtype)
        # a dtype numpy has is made as such: a view would be one more MLX op, evaluated
        # by the restore's last eval (about 0.13 ms of a 1,000-token fetch of 8 buffers)
        self.array = mx.array(host.view(typed)) if typed else mx.array(host).view(x.dtype)
        return self.array

    def _fits(self, start: int, dtype: mx.Dtype, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``dtype`` and ``shape`` fits the buffer at ``start``
        (which is written in place)."""
        if self._host is None or len(shape) != 4 or dtype != self._dtype:
            return False
        b, h, cap, d = self._dims
        return shape[0] == b and shape[1] == h and shape[3] == d and 0 <= start <= cap - shape[2]

    def _write(self, start: int, x: HostArray | mx.array) -> None:
        if len(x.shape) != 4:
            raise LayoutMismatchError(f"block tensor has shape {x.shape}, expected 4 axes")
        if self._host is None:
            self.reserve(x)
            self.materialize()  # opens it; hot segments queued before are copied in first
        if not self._fits(start, x.dtype, x.shape):
            raise LayoutMismatchError(
                f"block tensor {x.dtype}{tuple(x.shape)} at token {start} does not fit "
                f"buffer {self.array.dtype}{self.array.shape}"
            )
        region = self._host[:, :, start : start + x.shape[2], :]
        region[...] = x.rows() if isinstance(x, HostArray) else host_bytes(x)  # releases the GIL

    def _open(self, array: mx.array) -> None:
        """Make ``array`` the buffer, written in place through its host view from now on."""
        mx.eval(array)  # cheap when the caller evaluated it with others
        self.array, self._dtype, self._dims = array, array.dtype, tuple(array.shape)
        self._host = host_view(array)
        advise_huge(self._host)


def _copy_run(host: np.ndarray, run: list[np.ndarray], start: int, end: int) -> None:
    """Segments (host bytes) of tokens ``[start, end)``, in order, into ``host`` (a
    buffer's bytes: (B, heads, capacity, dim bytes))."""
    out = host[:, :, start:end, :]
    try:
        np.concatenate(run, axis=2, out=out) if len(run) > 1 else np.copyto(out, run[0])
    except ValueError as err:  # another head count or head size
        raise LayoutMismatchError(f"block tensors do not fit the buffer: {err}") from None


class _Views:
    """Host bytes of consecutive hot segments queued together, and their end token."""

    __slots__ = ("end", "views")

    def __init__(self, views: list[np.ndarray], end: int):
        self.views, self.end = views, end


_first = operator.itemgetter(0)  # a queued segment's first token
# MLX dtypes numpy has under the same bits (bfloat16 is not one of them)
_NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16}
