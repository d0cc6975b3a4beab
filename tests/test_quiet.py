"""The quiet window: after a fetch, the background writers and promotions start
nothing new (its request's prefill runs then) unless it is urgent. Real writer
and prefetch threads, a real SSD tier; a window of 30 s stands for "still open"
and is closed by the test."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_promote import BLOCK, on_ssd_only
from test_writer import Sink, item

from prefixcache import CacheConfig, PrefixCache
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiers import quiet
from prefixcache.tiers.writer import Writer

LONG = 30.0  # seconds: no test waits for it


@pytest.fixture(autouse=True)
def closed_window():
    quiet.close_window()
    yield
    quiet.close_window()


class Signal(Sink):
    """A sink that says when its first batch arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def write(self, items) -> None:
        super().write(items)
        self.wrote.set()


@pytest.fixture
def writer():
    made: list[Writer] = []

    def make(sink: Sink, max_bytes: int = 1000) -> Writer:
        made.append(Writer(sink.write, housekeeping=sink.housekeeping, max_bytes=max_bytes))
        return made[-1]

    yield make
    quiet.close_window()
    for w in made:
        w.close()


def test_an_open_window_holds_writes_until_it_closes(writer):
    sink = Signal()
    w = writer(sink)
    quiet.open_window(LONG)
    w.submit(item(0))
    assert not sink.wrote.wait(0.3)  # held: the window is open
    assert w.pending(item(0).block.key) is not None  # and the block stays readable
    quiet.close_window()
    w.wake()  # the writer waits with a timeout of the window's length: look again now
    assert sink.wrote.wait(10)


def test_without_a_window_writes_start_at_once(writer):
    """The control: the same submit with no window open is written without a flush."""
    sink = Signal()
    writer(sink).submit(item(0))
    assert sink.wrote.wait(10)


def test_a_flush_writes_inside_the_window(writer):
    sink = Signal()
    w = writer(sink)
    quiet.open_window(LONG)
    w.submit(item(0))
    start = time.monotonic()
    w.flush()
    assert sink.batches == [[item(0).block.key]] and time.monotonic() - start < 10


def test_a_queue_over_half_full_writes_inside_the_window(writer):
    sink = Signal()
    w = writer(sink, max_bytes=250)
    quiet.open_window(LONG)
    w.submit(item(0))
    assert not sink.wrote.wait(0.3)  # 100 of 250 bytes: held
    w.submit(item(1))  # 200 of 250: over half
    assert sink.wrote.wait(10)


@pytest.mark.parametrize("quiet_ms", [int(LONG * 1000), 0], ids=["window", "no_window"])
def test_a_promotion_starts_once_the_fetch_window_closes(tmp_path, quiet_ms):
    """An SSD hit's promotion waits while the window its fetch opened is open; with
    ``background_quiet_ms=0`` (the control) it runs at once. A flush does not wait."""
    model = tiny_model("llama")
    tokens = prompt(1, 4 * BLOCK)
    config = write_through(tmp_path, quiet_ms)
    with PrefixCache(model, config, model_id="tiny") as pc:
        on_ssd_only(pc, model, tokens)
        _, n = pc.fetch([*tokens, 5])
        assert n == len(tokens)
        if quiet_ms:  # still waiting for the window: hot still empty
            assert not promoted(pc, within=0.3)
            start = time.monotonic()
            pc.flush()  # urgent: promotes now
            assert time.monotonic() - start < 10
        else:  # no flush: the prefetch thread promotes on its own
            assert promoted(pc, within=10)
        assert len(pc.hot) == 4 and pc.stats()["num_promotions"] == 4


def write_through(ssd_dir, quiet_ms: int) -> CacheConfig:
    return CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(ssd_dir),
        write_policy="write_through",
        background_quiet_ms=quiet_ms,
    )


def promoted(pc: PrefixCache, *, within: float) -> bool:
    """Whether hot holds the promoted blocks within ``within`` seconds (looked at
    without joining the prefetch thread: a join is urgent and ends the wait)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with pc._lock:
            if len(pc.hot):
                return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("quiet_ms", [3000, 0], ids=["window", "no_window"])
def test_the_server_s_last_insert_of_a_request_holds_its_writes(tmp_path, quiet_ms):
    """mlx-lm's server inserts a request's cache when it ends, and the next request's
    fetch follows at once: the adapter opens the window there, so the writer does
    not start on that insert's blocks beside the next prefill (here a 3 s window,
    which closes by itself). The control (``background_quiet_ms=0``) writes them
    at once."""
    model = tiny_model("llama")
    tokens = prompt(2, 4 * BLOCK)
    config = write_through(tmp_path, quiet_ms)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    with TieredPromptCache(lambda k: model, config) as tiered:
        start = time.monotonic()
        tiered.insert_cache(("/models/tiny", None, None), tokens, cache)
        ssd = tiered.cache.ssd
        if quiet_ms:
            time.sleep(0.3)
            assert quiet.remaining() > 0
            assert ssd.stats()["num_writes"] == 0  # held while the window is open
        while ssd.stats()["num_writes"] < 4 and time.monotonic() < start + 15:
            time.sleep(0.01)
        assert ssd.stats()["num_writes"] == 4
        took = time.monotonic() - start
        assert took >= 2.5 if quiet_ms else took < 2.5
