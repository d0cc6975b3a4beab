"""bench_serve's replay of its trace through one prompt cache, driven as mlx-lm's
server drives it on the batch path; alone, or in lockstep with other systems'
replays (request by request)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator

from prefixcache.serve.prompt_cache import TieredPromptCache

KEY = ("bench-llama", None, None)


@dataclass(slots=True)
class Result:
    name: str
    budget: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    fetches: list[float] = field(default_factory=list)  # fetch_nearest_cache, per request
    peak_bytes: int = 0
    resumed_prompt: int = 0  # first request of each conversation resumed after the restart
    resumed_cached: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    recompute_flops: float = 0.0  # of the tokens prefilled (costs.py: attention grows with depth)


def serve(cache: Any, gen: BatchGenerator, prompt: list[int], sys_end: int, args, result: Result):
    """One request, as mlx-lm's server batch path runs it; returns (tokens, cached)."""
    start = time.perf_counter()
    restored, rest = cache.fetch_nearest_cache(KEY, prompt)
    result.fetches.append(time.perf_counter() - start)
    num_cached = len(prompt) - len(rest)
    segments = [prompt[num_cached:sys_end], prompt[max(sys_end, num_cached) :]]
    types = [t for s, t in zip(segments, ("system", "user"), strict=True) if s][::-1]
    gen.insert_segments(
        segments=[[s for s in segments if s]],
        max_tokens=[args.max_tokens],
        caches=[restored],
        all_tokens=[prompt[:num_cached]],
    )
    cache.trim_to(n_bytes=result.budget - gen.prompt_cache_nbytes)
    out: list[int] = []
    for _ in range(len(prompt) + args.max_tokens + 8):  # bounded: >= one token per step
        prompt_done, generated = gen.next()
        ends = [r.uid for r in prompt_done if r.end_of_segment and not r.end_of_prompt and types]
        for layers, tokens in gen.extract_cache(ends).values():
            cache.insert_cache(KEY, tokens[:], layers, cache_type=types.pop())
            result.peak_bytes = max(result.peak_bytes, cache.nbytes)
        for r in generated:
            if not out:
                result.ttfts.append(time.perf_counter() - start)
            out.append(r.token)
            if r.finish_reason is not None:
                cache.insert_cache(KEY, r.all_tokens[:], r.prompt_cache, cache_type="assistant")
                result.peak_bytes = max(result.peak_bytes, cache.nbytes)
                return out, num_cached
    raise RuntimeError("generation did not finish")


def replay(name: str, budget: int, make_cache, model, systems, trace, args):
    """Serve ``trace`` one request per ``next``; the cache and the batch generator are
    rebuilt halfway (restart). Returns (StopIteration's value) the Result, whose
    ``seconds`` count this system's own steps only (in lockstep, not the others')."""
    result = Result(name, budget)
    histories: dict[int, list[int]] = {}
    restart_at, resumed = len(trace) // 2, set()
    step = time.perf_counter()
    cache, gen = make_cache(), BatchGenerator(model)
    for i, turn in enumerate(trace):
        if i == restart_at:
            gen.close()
            _close(cache)
            cache, gen = make_cache(), BatchGenerator(model)
            resumed = set(histories)
        prompt = histories.get(turn.conv, systems[turn.system]) + turn.user
        out, num_cached = serve(cache, gen, prompt, len(systems[turn.system]), args, result)
        histories[turn.conv] = prompt + out
        result.outputs.append(out)
        result.prompt_tokens += len(prompt)
        result.cached_tokens += num_cached
        result.recompute_flops += args.cost.flops(num_cached, len(prompt) - num_cached)
        if turn.conv in resumed:
            resumed.discard(turn.conv)
            result.resumed_prompt += len(prompt)
            result.resumed_cached += num_cached
        result.seconds += time.perf_counter() - step
        if getattr(args, "lockstep", False) and isinstance(cache, TieredPromptCache):
            inner = getattr(cache, "_cache", None)  # the open PrefixCache, if any
            if inner is not None:
                inner.flush()  # its background writes land outside every system's timings
        yield
        step = time.perf_counter()
    gen.close()
    _close(cache)
    result.seconds += time.perf_counter() - step
    return result


def run(name: str, budget: int, make_cache, model, systems, trace, args) -> Result:
    """Replay ``trace`` through one system, start to end."""
    return finish(replay(name, budget, make_cache, model, systems, trace, args))


def finish(steps) -> Result:
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def lockstep(steps: list, reverse: bool) -> list[Result]:
    """Advance every system's replay one request at a time, the first to go rotating
    with each request (so a drift of the machine's speed weighs on all alike)."""
    live = list(range(len(steps)))
    results: dict[int, Result] = {}
    i = 0
    try:
        while live:
            turn = live[i % len(live) :] + live[: i % len(live)]
            for k in turn[::-1] if reverse else turn:
                try:
                    next(steps[k])
                except StopIteration as stop:
                    results[k] = stop.value
                    live.remove(k)
            i += 1
    finally:  # one failed: the others' clean-up (their servers, caches) runs now
        for k in live:
            steps[k].close()
    return [results[k] for k in range(len(steps))]


def _close(cache: Any) -> None:
    if isinstance(cache, TieredPromptCache):
        cache.close()


def pooled(rounds: list[Result]) -> Result:
    """One system's rounds as one result: TTFTs and counts summed over rounds;
    the replies are the first round's (RuntimeError if another's differ)."""
    out = Result(rounds[0].name, rounds[0].budget, outputs=rounds[0].outputs)
    for r in rounds:
        if r.outputs != out.outputs:
            raise RuntimeError(f"{r.name}: replies differ between rounds")
        out.prompt_tokens += r.prompt_tokens
        out.cached_tokens += r.cached_tokens
        out.ttfts += r.ttfts
        out.fetches += r.fetches
        out.peak_bytes = max(out.peak_bytes, r.peak_bytes)
        out.resumed_prompt += r.resumed_prompt
        out.resumed_cached += r.resumed_cached
        out.seconds += r.seconds
        out.recompute_flops += r.recompute_flops
    return out
