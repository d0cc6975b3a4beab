"""Writer: a real daemon thread draining a byte-bounded queue (no mocks, no sleeps)."""

from __future__ import annotations

import logging
import threading

import pytest
from ssd_child import make_block

from prefixcache.memory.host import tensors_of
from prefixcache.tiers.writer import WriteItem, Writer


def item(index: int, nbytes: int = 100) -> WriteItem:
    block = make_block(40, index)
    return WriteItem(block, tensors_of(block.arrays), nbytes)


class Sink:
    """A real write function: records batches, can be told to fail."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[bytes]] = []
        self.fail_on = fail_on
        self.rounds = 0
        self.thread_names: set[str] = set()

    def write(self, items: list[WriteItem]) -> None:
        self.thread_names.add(threading.current_thread().name)
        keys = [it.block.key for it in items]
        if self.fail_on is not None and make_block(40, self.fail_on).key in keys:
            raise OSError(5, "injected I/O error")
        self.batches.append(keys)

    def housekeeping(self) -> None:
        self.rounds += 1


@pytest.fixture
def writers():
    made: list[Writer] = []

    def make(sink: Sink, **kwargs) -> Writer:
        kwargs.setdefault("max_bytes", 1000)
        writer = Writer(sink.write, housekeeping=sink.housekeeping, **kwargs)
        made.append(writer)
        return writer

    yield make
    for writer in made:
        writer.close()


def test_items_are_written_in_order_on_the_writer_thread(writers):
    sink = Sink()
    writer = writers(sink)
    items = [item(i) for i in range(8)]
    assert all(writer.submit(it) for it in items)
    writer.flush()
    assert [k for batch in sink.batches for k in batch] == [it.block.key for it in items]
    assert sink.thread_names == {"prefixcache-ssd-writer"}
    assert writer.queue_depth == 0 and writer.queue_bytes == 0


def test_queue_is_bounded_in_bytes_and_items_stay_pending_until_written(writers):
    hold, sink = threading.Event(), Sink()
    writer = writers(sink, max_bytes=250, hold=hold)
    a, b, c = item(0), item(1), item(2)
    assert writer.submit(a) and writer.submit(b)
    assert not writer.submit(c)  # 300 > 250 bytes
    assert writer.queue_bytes == 200 and writer.queue_depth == 2
    assert writer.pending(a.block.key) is a and writer.pending(c.block.key) is None
    keys = [c.block.key, a.block.key, b.block.key, a.block.key]
    assert writer.pending_many(keys) == [None, a, b, a]  # each key's, in order
    assert writer.submit(a)  # already queued: accepted, not queued twice
    assert writer.queue_depth == 2
    hold.set()
    writer.flush()
    assert writer.pending(a.block.key) is None and sink.batches == [[a.block.key, b.block.key]]
    assert writer.pending_many(keys) == [None] * 4  # written: none pending
    assert writer.submit(c)


def test_batches_are_cut_by_bytes(writers):
    hold, sink = threading.Event(), Sink()
    writer = writers(sink, max_bytes=10_000, batch_bytes=250, hold=hold)
    for i in range(5):
        writer.submit(item(i))
    hold.set()
    writer.flush()
    assert [len(batch) for batch in sink.batches] == [2, 2, 1]


def test_flush_runs_housekeeping_even_with_nothing_queued(writers):
    sink = Sink()
    writer = writers(sink)
    writer.flush()
    rounds = sink.rounds
    writer.flush()
    assert sink.rounds > rounds >= 1


def test_failures_are_counted_logged_once_and_reraised_on_close(caplog):
    sink = Sink(fail_on=1)
    writer = Writer(sink.write, max_bytes=1000, batch_bytes=1)
    with caplog.at_level(logging.DEBUG, logger="prefixcache.tiers.writer"):
        for i in range(3):
            writer.submit(item(i))
        writer.flush()
        assert writer.run_inline([item(1)]) is False  # the same failure on the caller's thread
    assert writer.num_failures == 2
    assert [r.levelname for r in caplog.records] == ["ERROR", "DEBUG"]
    assert len(sink.batches) == 2  # the others were written: the thread lives on
    assert writer.pending(item(1).block.key) is None  # a failed item does not stay pending
    with pytest.raises(OSError, match="injected"):
        writer.close()
    writer.close()  # raised once


def test_submit_after_close_raises(writers):
    writer = writers(Sink())
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(item(0))


def test_an_empty_queue_takes_one_item_bigger_than_the_bound(writers):
    """A bound below one block (a small hot budget's default) still lets blocks
    through one at a time; a second item waits for the first (refused)."""
    hold = threading.Event()
    writer = writers(Sink(), max_bytes=50, hold=hold)
    assert writer.submit(item(0))  # 100 > 50 bytes, but the queue is empty
    assert not writer.submit(item(1))
    assert writer.queue_bytes == 100
    hold.set()
    writer.flush()
    assert writer.queue_bytes == 0 and writer.submit(item(1))


@pytest.mark.parametrize("run_tokens", [0, 64])
def test_a_batch_cut_inside_a_chain_ends_at_a_whole_run(writers, run_tokens):
    """A batch full at its byte bound inside a chain that goes on in the queue ends at
    the chain's last whole run of ``run_tokens`` (the SSD tier's run files), so no
    short file is cut at the bound; with 0 (the control) it ends where the bound falls.
    Blocks of 16 tokens: 64 tokens are 4 blocks."""
    hold, sink = threading.Event(), Sink()
    writer = writers(sink, max_bytes=10_000, batch_bytes=700, run_tokens=run_tokens, hold=hold)
    chain = [item(i) for i in range(10)]  # one chain, 100 bytes a block: 7 fit a batch
    assert all(writer.submit(it) for it in chain)
    hold.set()
    writer.flush()
    sizes = [len(batch) for batch in sink.batches]
    assert sizes == ([4, 6] if run_tokens else [7, 3])
    assert [k for batch in sink.batches for k in batch] == [it.block.key for it in chain]


@pytest.mark.parametrize("run_tokens", [0, 64])
def test_a_batch_full_while_a_store_still_queues_ends_at_a_whole_run(writers, run_tokens):
    """A batch full at its byte bound with nothing after it in the queue, while items
    keep coming (the last within ``linger``, nothing urgent: a store still queuing),
    ends at its chain's last whole run; the rest goes with the next batch (here the
    flush's). With 0 (the control) it takes all it holds."""
    hold, written, sink = threading.Event(), threading.Event(), Sink()
    write = sink.write

    def signalled(items):
        write(items)
        written.set()

    sink.write = signalled
    writer = writers(
        sink, max_bytes=10_000, batch_bytes=700, run_tokens=run_tokens, hold=hold, linger=60.0
    )
    chain = [item(i) for i in range(7)]  # 100 bytes a block: the batch's bound
    assert all(writer.submit(it) for it in chain)
    hold.set()
    assert written.wait(30)  # the first batch, taken before the flush below
    writer.flush()
    assert [len(batch) for batch in sink.batches] == ([4, 3] if run_tokens else [7])
    assert [k for batch in sink.batches for k in batch] == [it.block.key for it in chain]


def test_a_batch_ends_at_the_bound_where_the_chain_stops_or_holds_no_whole_run(writers):
    hold, sink = threading.Event(), Sink()
    writer = writers(sink, max_bytes=10_000, batch_bytes=300, run_tokens=64, hold=hold)
    other = WriteItem(make_block(41, 0), [], 100)  # another chain's block after 3 of this one
    assert all(writer.submit(it) for it in [item(0), item(1), item(2), other, item(3)])
    hold.set()
    writer.flush()
    # 3 blocks fill the batch; the next queued is another chain's: no cut inside a run
    assert [len(b) for b in sink.batches] == [3, 2]
    hold.clear()
    sink.batches.clear()
    assert all(writer.submit(item(i, 200)) for i in range(4, 7))  # 200 bytes: one a batch
    hold.set()
    writer.flush()
    assert [len(b) for b in sink.batches] == [1, 1, 1]  # no whole run fits: one at a time
