"""Scenario threads: many threads fetch, store and match on one PrefixCache.

The hot and SSD budgets are a fraction of the prompts' blocks, so every op
evicts or spills. Every restore's K/V are compared with the live cache of its
prompt (computed once), every ``logits_every``-th one also by its logits; the
hot tier's bytes are checked after every op. Every ``quiesce_every`` ops the
threads meet at a barrier: one flushes and the payload bytes on disk are
measured exactly (and must equal the tier's own count); meanwhile a sampler
thread measures them continuously (a walk that skips files changed during it).

``hand_over`` (the "kept" scenario) runs it as a server does: stores hand their
caches over (``restore_headroom=0``: kept whole in hot, tiers/recent.py), and
every fetched cache is prefilled to its prompt's end, checked by its logits,
and stored handed over in turn, so fetches get views that are written into.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

from . import common
from .common import Result, Tally, Workload, make_prompts, open_cache

BLOCK_BYTES = 8192


@dataclass(frozen=True, slots=True)
class ThreadSetup:
    threads: int = 8
    ops: int = 10_000  # per thread
    seed: int = 0
    groups: int = 8
    per_group: int = 6
    hot_bytes: int = 12 * BLOCK_BYTES
    ssd_bytes: int = 40 * BLOCK_BYTES
    logits_every: int = 50
    quiesce_every: int = 500
    hand_over: bool = False  # stores hand their caches over (kept whole in hot)


class _Run:
    """State shared by the worker threads of one run."""

    def __init__(self, setup: ThreadSetup, work: Workload, pc, ssd_dir: str):
        self.setup, self.work, self.pc, self.ssd_dir = setup, work, pc, ssd_dir
        self.model_lock = threading.Lock()  # one model forward at a time
        self.barrier = threading.Barrier(setup.threads)
        self.tallies = [Tally() for _ in range(setup.threads)]
        self.stop = threading.Event()
        self.max_sampled = 0

    def op(self, rng: random.Random, tally: Tally, k: int) -> None:
        work, pc = self.work, self.pc
        i = rng.randrange(len(work.prompts))
        roll = rng.random()
        if roll < 0.45:
            cache, n = pc.fetch(work.prompts[i])
            ok = work.same_kv(i, cache, n)
            if self.setup.hand_over or k % self.setup.logits_every == 0:
                with self.model_lock:
                    ok = work.exact(i, cache, n) and ok  # prefills it to the prompt's end
                if self.setup.hand_over and ok:
                    pc.store(work.prompts[i], cache, hand_over=True)  # as the server does
            tally.checked += n > 0
            if not ok:
                tally.wrong += 1
                tally.findings.append(f"wrong restore of prompt {i} ({n} tokens)")
        elif roll < 0.8:
            pc.store(work.prompts[i], work.reference(i)[1], hand_over=self.setup.hand_over)
        else:
            n = pc.match(work.prompts[i])
            if not 0 <= n < len(work.prompts[i]):  # partial blocks: any length below the prompt
                tally.errors += 1
                tally.findings.append(f"match gave {n} for a {len(work.prompts[i])}-token prompt")
        hot = pc.stats()["hot"]["nbytes"]
        if hot > self.setup.hot_bytes:
            tally.errors += 1
            tally.findings.append(f"hot tier holds {hot} bytes > {self.setup.hot_bytes}")
        tally.ops += 1

    def quiesce(self, tally: Tally) -> None:
        """All threads wait; one flushes and measures the directory exactly."""
        if self.barrier.wait() == 0:
            self.pc.flush()
            on_disk = common.payload_bytes(self.ssd_dir)
            counted = self.pc.stats()["ssd"]["nbytes"]
            if on_disk > self.setup.ssd_bytes or on_disk != counted:
                tally.errors += 1
                tally.findings.append(
                    f"on disk {on_disk} B, tier says {counted}, cap {self.setup.ssd_bytes}"
                )
        self.barrier.wait()

    def worker(self, t: int) -> None:
        rng, tally = random.Random(self.setup.seed * 1000 + t), self.tallies[t]
        try:
            for k in range(self.setup.ops):
                self.op(rng, tally, k)
                if (k + 1) % self.setup.quiesce_every == 0:
                    self.quiesce(tally)
        except threading.BrokenBarrierError:
            pass  # another thread failed: it reported why
        except Exception:  # reported, and the run fails
            tally.errors += 1
            tally.findings.append(traceback.format_exc(limit=4))
            self.barrier.abort()

    def sampler(self) -> None:
        while not self.stop.wait(0.001):  # bytes on disk every millisecond (plus the walk)
            self.max_sampled = max(self.max_sampled, common.on_disk_now(self.ssd_dir))


def run(setup: ThreadSetup, base_dir: str | None = None) -> Result:
    start = time.perf_counter()
    work = Workload(make_prompts(setup.groups, setup.per_group, seed=2))
    for i in range(len(work.prompts)):
        work.reference(i)  # computed before the threads start
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="soak-threads-") as tmp:
        kept = {"restore_headroom": 0} if setup.hand_over else {}
        pc = open_cache(
            work.model, tmp, hot_max_bytes=setup.hot_bytes, ssd_max_bytes=setup.ssd_bytes, **kept
        )
        state = _Run(setup, work, pc, tmp)
        threads = [threading.Thread(target=state.worker, args=(t,)) for t in range(setup.threads)]
        sampler = threading.Thread(target=state.sampler)
        for th in [*threads, sampler]:
            th.start()
        for th in threads:
            th.join()
        state.stop.set()
        sampler.join()
        stats = pc.stats()
        pc.close()
    tally = Tally()
    for part in state.tallies:
        tally.ops, tally.checked = tally.ops + part.ops, tally.checked + part.checked
        tally.wrong, tally.errors = tally.wrong + part.wrong, tally.errors + part.errors
        tally.findings += part.findings[:5]
    if state.max_sampled > setup.ssd_bytes:
        tally.errors += 1
        tally.findings.append(f"sampled {state.max_sampled} B on disk > cap {setup.ssd_bytes}")
    ssd = stats["ssd"]
    notes = (
        f"{setup.threads} threads x {setup.ops} ops; hot evictions "
        f"{stats['hot']['num_evictions']}, spills {stats['num_spills']}, ssd evictions "
        f"{ssd['num_evictions']}, max sampled on disk {state.max_sampled} B "
        f"<= cap {setup.ssd_bytes} B"
    )
    if setup.hand_over:
        notes += f"; fetches from kept sequences {stats['hot']['num_recent_hits']}"
    return tally.result("kept" if setup.hand_over else "threads", start, notes)
