"""What every soak scenario shares: prompts, live references, the exactness check.

A prompt is served as a scheduler serves it: ``fetch`` the longest cached
prefix, prefill the rest in chunks of ``STEP`` tokens, ``store`` the full
cache. Chunks start at multiples of ``STEP`` whatever the cached length (a
multiple of the block size), so the logits of a served prompt must equal the
live run's bit for bit on the CPU; any difference is a wrong restore.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model

BLOCK = 16
STEP = 16  # prefill chunk: equal to BLOCK, so every chunk boundary is a block boundary
MODEL_ID = "soak-tiny-llama"
VOCAB = 512


@dataclass(frozen=True, slots=True)
class Result:
    """One scenario's outcome: ``wrong`` and ``errors`` must be 0 for a pass."""

    name: str
    ops: int
    checked: int  # restores (num_cached > 0) compared against the live run
    wrong: int
    errors: int
    seconds: float
    notes: str = ""
    findings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.errors == 0


@dataclass(slots=True)
class Tally:
    """Counters a scenario fills while it runs."""

    ops: int = 0
    checked: int = 0
    wrong: int = 0
    errors: int = 0
    findings: list[str] = field(default_factory=list)

    def result(self, name: str, start: float, notes: str = "") -> Result:
        return Result(
            name,
            self.ops,
            self.checked,
            self.wrong,
            self.errors,
            time.perf_counter() - start,
            notes,
            tuple(self.findings),
        )


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def make_prompts(num_groups: int, per_group: int, seed: int = 0) -> list[list[int]]:
    """Prompts in groups: each group shares a 2-block prefix, suffixes differ.

    Every prompt ends in a tail of at least 2 tokens, so serving it again reads
    every block it stored, the tail too (cut back: one token is left to prefill).
    """
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        system = tokens(seed * 1000 + g, 2 * BLOCK)
        for p in range(per_group):
            n = int(rng.integers(BLOCK // 2, 4 * BLOCK))
            n += 2 if n % BLOCK == 0 else 1 if n % BLOCK == 1 else 0
            out.append(system + tokens(seed * 1000 + 100 * (g + 1) + p, n))
    return out


def prefill(model, toks: list[int], cache: list) -> mx.array:
    """Run ``toks`` through ``model`` in STEP-token chunks; the last token's logits."""
    logits = None
    for start in range(0, len(toks), STEP):
        logits = model(mx.array([toks[start : start + STEP]]), cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
    return logits


class Workload:
    """A tiny model, its prompts, and live references computed once per prompt."""

    def __init__(self, prompts: list[list[int]], arch: str = "llama"):
        self.model = build_model(arch)
        self.prompts = prompts
        self._logits: dict[int, mx.array] = {}
        self._caches: dict[int, list] = {}

    def reference(self, i: int) -> tuple[mx.array, list]:
        """(logits, full cache) of prompt ``i`` computed live from scratch."""
        if i not in self._logits:
            cache = make_prompt_cache(self.model)
            self._logits[i] = prefill(self.model, self.prompts[i], cache)
            self._caches[i] = cache
        return self._logits[i], self._caches[i]

    def exact(self, i: int, cache: list, num_cached: int) -> bool:
        """Prefill the rest of prompt ``i`` into ``cache``; True if the logits are the live's."""
        logits = prefill(self.model, self.prompts[i][num_cached:], cache)
        return bool(mx.array_equal(logits, self.reference(i)[0]).item())

    def same_kv(self, i: int, cache: list, num_cached: int) -> bool:
        """True if the restored K/V of every layer equal the live cache's first tokens."""
        if num_cached == 0:
            return all(c.offset == 0 for c in cache)
        ref = self.reference(i)[1]
        for got, want in zip(cache, ref, strict=True):
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                if not mx.array_equal(a[..., :num_cached, :], b[..., :num_cached, :]).item():
                    return False
        return True

    def serve(self, pc: PrefixCache, i: int, tally: Tally, *, store: bool = True) -> int:
        """Fetch, check exactly, store prompt ``i``; returns the cached length."""
        cache, num_cached = pc.fetch(self.prompts[i])
        ok = self.exact(i, cache, num_cached)
        tally.ops += 1
        if num_cached:
            tally.checked += 1
        if not ok:
            tally.wrong += 1
            tally.findings.append(f"wrong restore of prompt {i} ({num_cached} tokens cached)")
        if store:
            pc.store(self.prompts[i], cache)
        return num_cached

    def negative_control(self) -> bool:
        """True if the check rejects another prompt's cache (so it can catch a wrong restore)."""
        a, b = self.prompts[0], self.prompts[-1]
        n = 2 * BLOCK
        if a[:n] == b[:n]:
            raise ValueError("negative control needs prompts of different groups")
        own, other = make_prompt_cache(self.model), make_prompt_cache(self.model)
        prefill(self.model, a[:n], own)
        prefill(self.model, b[:n], other)
        return self.exact(0, own, n) and not self.exact(0, other, n)


def config(ssd_dir: str | None, **changes: object) -> CacheConfig:
    """The soak's CacheConfig: BLOCK-token blocks, no free-space floor."""
    base = CacheConfig(block_size=BLOCK, ssd_min_free_bytes=0, restore_headroom=BLOCK)
    if ssd_dir is None:
        return base.replace(hot_cache_only=True, **changes)
    return base.replace(ssd_dir=ssd_dir, **changes)


def open_cache(model, ssd_dir: str | None, **changes: object) -> PrefixCache:
    return PrefixCache(model, config(ssd_dir, **changes), model_id=MODEL_ID)


def payload_bytes(ssd_dir: str) -> int:
    """Bytes of every file under ``ssd_dir/blocks`` (payloads and temp files); exact only
    while nothing writes: a walk is not one instant."""
    return bytes_before(walk_files(ssd_dir), None)


def on_disk_now(ssd_dir: str) -> int:
    """Bytes on disk under ``ssd_dir/blocks`` at one instant, at most (for sampling while
    the tier writes). A plain walk can count a block evicted behind it and the block
    that took its room ahead of it, over the cap though the tier never was."""
    before = coarse_now_ns()
    return bytes_before(walk_files(ssd_dir), before)


def bytes_before(files: Iterable[tuple[str, os.stat_result]], before_ns: int | None) -> int:
    """The sizes of ``files``; with ``before_ns`` (a CLOCK_REALTIME_COARSE reading taken
    before the walk, the clock file times come from) only of those whose change time is
    older: every file counted was then on disk at that size, so the sum is at most what
    the disk held at that instant."""
    return sum(st.st_size for _, st in files if before_ns is None or st.st_ctime_ns < before_ns)


def walk_files(ssd_dir: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, stat) of every file under ``ssd_dir/blocks``; one gone meanwhile is skipped."""
    for d, _, files in os.walk(os.path.join(ssd_dir, "blocks")):
        for name in files:
            path = os.path.join(d, name)
            try:
                yield path, os.stat(path)
            except FileNotFoundError:
                continue


def coarse_now_ns() -> int:
    return time.clock_gettime_ns(getattr(time, "CLOCK_REALTIME_COARSE", time.CLOCK_REALTIME))


def temp_files(ssd_dir: str) -> list[str]:
    root = os.path.join(ssd_dir, "blocks")
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``prefixcache ARGS`` in a subprocess (as an operator would)."""
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
