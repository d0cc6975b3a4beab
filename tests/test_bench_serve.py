"""bench_serve's lockstep replay: the systems take a tiny trace request by request,
each request's first system rotating, and each system does exactly what it does
when it replays the trace alone (same replies, same cached tokens)."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import bench_serve
import serve_replay
from mlx_lm.models.cache import LRUPromptCache

from prefixcache.config import CacheConfig
from prefixcache.serve.prompt_cache import TieredPromptCache

ARGS = "--conversations 2 --turns 3 --active 2 --systems 1 --system-tokens 40 --user-tokens 8"
ARGS += " --max-tokens 3 --hidden 64 --block-size 16"


def _systems(model, tmp: str):
    hot = CacheConfig(block_size=16, hot_cache_only=True, restore_headroom=0)
    ssd = hot.replace(hot_cache_only=False, hot_max_bytes=1 << 16, ssd_dir=tmp)
    return [
        ("mlx-lm LRU", lambda: LRUPromptCache(max_size=64)),
        ("ours hot-only", lambda: TieredPromptCache(lambda key: model, hot)),
        ("ours + SSD", lambda: TieredPromptCache(lambda key: model, ssd)),
    ]


def _replays(lockstep: bool):
    args = bench_serve.setup_arg_parser().parse_args(shlex.split(ARGS))
    args.lockstep = lockstep
    model = bench_serve.bench_model(args)
    systems, trace = bench_serve.make_trace(args)
    with tempfile.TemporaryDirectory() as tmp:
        made = _systems(model, tmp)
        steps = [
            serve_replay.replay(name, 8 << 20, make, model, systems, trace, args)
            for name, make in made
        ]
        start = time.perf_counter()
        if lockstep:
            results = serve_replay.lockstep(steps, reverse=False)
        else:
            results = [serve_replay.finish(s) for s in steps]
        return results, time.perf_counter() - start


def test_lockstep_serves_as_the_replays_alone():
    (alone, _), (together, wall) = _replays(False), _replays(True)
    assert [r.name for r in together] == ["mlx-lm LRU", "ours hot-only", "ours + SSD"]
    for a, t in zip(alone, together, strict=True):
        assert len(t.ttfts) == len(t.outputs) == 6
        assert t.outputs == a.outputs == alone[0].outputs
        assert (t.prompt_tokens, t.cached_tokens) == (a.prompt_tokens, a.cached_tokens)
    assert together[1].cached_tokens > 0  # the conversations share a system prompt
    assert together[2].cached_tokens > together[1].cached_tokens  # the SSD tier kept more
    # each system's seconds are its own steps: together they fit in the lockstep's wall
    assert all(t.seconds > 0 for t in together)
    assert sum(t.seconds for t in together) <= wall


def _recorder(log: list, name: str, steps: int):
    for i in range(steps):
        log.append((i, name))
        yield
    return name


def test_lockstep_rotates_the_first_system():
    log: list = []
    names = ["a", "b", "c"]
    out = serve_replay.lockstep([_recorder(log, n, 3) for n in names], reverse=False)
    assert out == names  # each replay's return value, in the systems' order
    firsts = [next(n for i, n in log if i == step) for step in range(3)]
    assert firsts == ["a", "b", "c"]
    assert [n for i, n in log if i == 1] == ["b", "c", "a"]
    log.clear()
    serve_replay.lockstep([_recorder(log, n, 2) for n in names], reverse=True)
    assert [n for i, n in log if i == 0] == ["c", "b", "a"]
