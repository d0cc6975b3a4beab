"""The SSD stream's readers all start before any of them reads.

Starting a thread waits until it runs; a reader already reading would keep the
interpreter lock from the caller starting the next. So the readers wait for one
event, set once every one is started; where a start fails, the readers started
are stopped (none is left running, holding its loose buffer for a caller that
never comes) and the failure raised.
"""

from __future__ import annotations

import threading

from ssd_child import check_block
from test_ssd_stream import stored

from prefixcache.tiers.ssd import readers
from prefixcache.tiers.ssd import runs as ssd_runs
from prefixcache.tiers.ssd import stream as ssd_stream
from prefixcache.tiers.ssd.stream import stream


def test_no_reader_reads_before_every_reader_is_started(tier, monkeypatch):
    monkeypatch.setattr(readers, "_WARM_READERS", 3)
    monkeypatch.setattr(readers, "_COLD_READERS", 3)
    keys = stored(tier, 41, 8)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", tier.get_meta(keys[0]).file_bytes)  # a run each
    started: list[str] = []
    early: list[tuple[str, list[str]]] = []  # a run read while a start was still to come
    start = threading.Thread.start

    def counted(self):
        start(self)
        started.append(self.name)

    read = readers.Readers._outcomes

    def watched(self, run, bufs):
        if len(started) < len(self._threads):
            early.append((threading.current_thread().name, list(started)))
        return read(self, run, bufs)

    monkeypatch.setattr(readers.threading.Thread, "start", counted)
    monkeypatch.setattr(readers.Readers, "_outcomes", watched)
    blocks = [b.to_block() for b in stream(tier.reads, keys)]
    assert [b.index for b in blocks] == list(range(8))
    for block in blocks:
        check_block(block)
    assert len(started) == 3
    assert not early, early


def test_a_failed_start_leaves_no_reader_waiting(tier, monkeypatch):
    """The second reader's start fails: the stream is refused, and the first reader
    is stopped, not left waiting (for the others, or for its loose buffer back)."""
    monkeypatch.setattr(readers, "_WARM_READERS", 2)
    monkeypatch.setattr(readers, "_COLD_READERS", 2)
    keys = stored(tier, 42, 6)
    monkeypatch.setattr(ssd_runs, "RUN_BYTES", tier.get_meta(keys[0]).file_bytes)
    jobs = ssd_stream._jobs(tier, keys)
    made: list[threading.Thread] = []
    start = threading.Thread.start

    def second_fails(self):
        if made:
            raise RuntimeError("can't start new thread")
        made.append(self)
        start(self)

    monkeypatch.setattr(readers.threading.Thread, "start", second_fails)
    try:
        readers.Readers(jobs, None)
    except RuntimeError as err:
        assert "can't start new thread" in str(err)
    else:
        raise AssertionError("the failed start was not raised")
    (first,) = made
    assert not first.is_alive()
