"""Hot-tier eviction benchmark: cost-aware (eviction="cost") vs LRU leaves-first.

Replays one trace through a hot-only PrefixCache (real ``fetch`` / ``store``
of real mlx-lm caches, ``hot_max_bytes`` = the budget, enforced at every
insert) per policy and budget: a few long agent sessions (histories growing
by a tool output + user message and a reply per turn to several thousand
tokens, each session live over part of the trace) interleaved at random with
many short one- or two-turn chats on shared system prompts, so the hot tier
cannot hold everything. Each request fetches, prefills the uncached tokens on
the model (chunks of <= 512), decodes the reply (teacher-forced, not timed)
and stores prompt + reply. Systems, at each budget (``--budget``):

  cost       eviction="cost": the least credit among the 32 least
             recently used leaves (GreedyDual-Size: FLOPs per byte over a rising
             floor, prefixcache/tiers/hot/credit.py)
  lru        eviction="lru": the least recently used leaf
  mlx-lm LRU LRUPromptCache(max_bytes=budget), whole sequences (--mlx-lru)

"recompute GFLOP" sums ``RecomputeCost.flops(cached, len(prompt) - cached)``
over requests (prefixcache/cache/costs.py: 2 x parameters per token plus, per
attention layer, FLOPs per context token): the work evictions left to redo,
free of timing noise; split into agent sessions and short chats. The default
model is a narrow 2-layer llama (MLP of 32) whose attention dominates at
depth: "cost model" in the header says from which depth. "prefill s" is the
measured model time on the uncached tokens (2-core CPU shared with whatever
else runs: compare within one run); ``--synthetic`` fills the caches with
zeros instead of running the model (same tokens and FLOPs, no seconds), fast
enough to sum many traces (``--seeds``): one trace's result swings with a few
whole-session misses. "ended-session tokens held": the tokens of sessions
past their last turn that hot could still restore, mean over requests (what
the budget spends on histories nobody resumes). "evictions" counts hot's
evictions; blocks dropped at insertion because their parent went are not in it.

    python tools/bench_eviction.py
    python tools/bench_eviction.py --synthetic --seeds 10 --budget 3M 6M 10M 16M
    python tools/bench_eviction.py --synthetic --seeds 10 --session-span 0.25
    python tools/bench_eviction.py --synthetic --seeds 10 --policies lru,cost,adaptive
    python tools/bench_eviction.py --synthetic --seeds 10 --policies lru --run-tokens 0,256,1024
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
from bench_serve import print_table
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, trim_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.costs import RecomputeCost
from prefixcache.config import parse_bytes
from prefixcache.tiny.models import build_model

MiB = 1 << 20
CHUNK = 512
MLX = "mlx-lm LRU"


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=4, help="long agent sessions")
    p.add_argument("--session-turns", type=int, default=12)
    p.add_argument("--session-span", type=float, default=0.5, help="share of the trace each lives")
    p.add_argument("--step-tokens", type=int, default=160, help="tool output + user, per turn")
    p.add_argument("--reply-tokens", type=int, default=32, help="decoded per request")
    p.add_argument("--chats", type=int, default=96, help="short chats")
    p.add_argument("--two-turn", type=float, default=0.5, help="share of chats with a 2nd turn")
    p.add_argument("--chat-tokens", type=int, default=96, help="user tokens per chat turn")
    p.add_argument("--systems", type=int, default=3, help="shared system prompts")
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--budget", type=parse_bytes, nargs="+", default=[3 * MiB, 6 * MiB])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=32, help="MLP width")
    p.add_argument("--heads", type=int, default=4, help="query heads (2 KV heads, head_dim 32)")
    p.add_argument("--synthetic", action="store_true", help="zeros for K/V, no model run")
    p.add_argument("--mlx-lru", action="store_true", help="also mlx-lm's LRUPromptCache")
    p.add_argument("--policies", default="lru,cost", help="hot evictions, the first the reference")
    p.add_argument(
        "--run-tokens",
        default="",
        help="hot_run_tokens values, each with every policy (0,256,1024; default: the config's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="traces (seed, seed + 1, ...), summed")
    return p


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # arrival time in [0, 1)
    conv: int  # sessions first, then chats
    system: int
    new: list[int]  # appended to the history: the turn's prompt tokens
    reply: list[int]  # decoded after the prompt, stored with it


def make_trace(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[Request]]:
    """(system prompts, requests in arrival order) from ``seed``."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, 500) for _ in range(n)]  # noqa: E731
    systems = [tokens(args.system_tokens) for _ in range(args.systems)]
    out, span = [], args.session_span
    for conv in range(args.sessions):
        start = rng.uniform(0, 1 - span)
        for turn in range(args.session_turns):
            at = start + span * (turn + rng.random() * 0.9) / args.session_turns
            step = tokens(rng.randint(args.step_tokens // 2, args.step_tokens * 3 // 2))
            out.append(Request(at, conv, conv % args.systems, step, tokens(args.reply_tokens)))
    for chat in range(args.sessions, args.sessions + args.chats):
        at, system = rng.random(), rng.randrange(args.systems)
        for _ in range(2 if rng.random() < args.two_turn else 1):
            user = tokens(rng.randint(args.chat_tokens // 2, args.chat_tokens * 3 // 2))
            out.append(Request(at, chat, system, user, tokens(args.reply_tokens)))
            at += rng.expovariate(100.0)  # the 2nd turn soon after
    return systems, sorted(out, key=lambda r: r.at)


class MlxLRU:
    """mlx-lm's LRUPromptCache behind PrefixCache's fetch / store."""

    def __init__(self, model: Any, budget: int):
        self.model, self.lru = model, LRUPromptCache(max_size=1 << 20, max_bytes=budget)

    def fetch(self, tokens: list[int]) -> tuple[list[Any], int]:
        cache, rest = self.lru.fetch_nearest_cache("m", tokens)
        if cache is None:
            return make_prompt_cache(self.model), 0
        if not rest:  # an exact hit: prefill its last token again
            trim_prompt_cache(cache, 1)
            return cache, len(tokens) - 1
        return cache, len(tokens) - len(rest)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        self.lru.insert_cache("m", list(tokens), cache)

    def close(self) -> None:
        pass


@dataclass(slots=True)
class Result:
    name: str
    budget: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    flops: dict[str, float] = field(default_factory=lambda: {"session": 0.0, "chat": 0.0})
    prefill_s: float = 0.0
    wall_s: float = 0.0
    seeds: int = 1
    synthetic: bool = False
    evictions: int = 0
    compacted: int = 0  # runs whose last blocks were copied out (hot_run_tokens)
    ended_held: float = 0.0  # tokens of ended sessions hot holds, mean over requests


def extend(model: Any, cache: list[Any], tokens: list[int], args) -> None:
    """Run ``tokens`` through the model into ``cache`` (chunks of <= 512), or with
    ``--synthetic`` append zero K/V of the same shape."""
    for i in range(0, len(tokens), CHUNK):
        chunk = tokens[i : i + CHUNK]
        if args.synthetic:
            kv = mx.zeros((1, 2, len(chunk), 32))
            mx.eval([c.update_and_fetch(kv, kv) for c in cache])
        else:
            mx.eval(model(mx.array([chunk]), cache=cache))


def run(result: Result, pc: Any, model, systems, trace, args) -> None:
    """Replay ``trace`` through ``pc`` (fetch, prefill, decode, store per request),
    adding to ``result``."""
    histories: dict[int, list[int]] = {}
    last = {req.conv: i for i, req in enumerate(trace)}
    began = time.perf_counter()
    for i, req in enumerate(trace):
        prompt = histories.get(req.conv, systems[req.system]) + req.new
        cache, cached = pc.fetch(prompt)
        start = time.perf_counter()
        extend(model, cache, prompt[cached:], args)
        result.prefill_s += time.perf_counter() - start
        extend(model, cache, req.reply, args)
        histories[req.conv] = prompt + req.reply
        pc.store(histories[req.conv], cache)
        result.prompt_tokens += len(prompt)
        result.cached_tokens += cached
        kind = "session" if req.conv < args.sessions else "chat"
        result.flops[kind] += args.cost.flops(cached, len(prompt) - cached)
        if isinstance(pc, PrefixCache):  # what hot still holds of sessions that ended
            ended = [h for c, h in histories.items() if c < args.sessions and last[c] <= i]
            result.ended_held += sum(map(pc.match, ended)) / len(trace)
    if isinstance(pc, PrefixCache):
        result.evictions += pc.stats()["hot"]["num_evictions"]
        result.compacted += pc.stats()["hot"]["num_runs_compacted"]
    pc.close()
    result.wall_s += time.perf_counter() - began


def summary(r: Result, reference: Result) -> dict[str, str]:
    total, ref = sum(r.flops.values()), sum(reference.flops.values())
    return {
        "budget": f"{r.budget / MiB:.1f} MiB",
        "system": r.name,
        "cached/prompt": f"{r.cached_tokens / r.prompt_tokens:6.1%}",
        "prefill tokens": f"{r.prompt_tokens - r.cached_tokens:,}",
        "recompute GFLOP": f"{total / 1e9:7.2f}",
        "vs lru": f"{total / ref - 1:+6.1%}" if ref else "-",
        "sessions GFLOP": f"{r.flops['session'] / 1e9:7.2f}",
        "chats GFLOP": f"{r.flops['chat'] / 1e9:7.2f}",
        "prefill s": "-" if r.synthetic else f"{r.prefill_s:6.2f}",
        "evictions": "-" if r.name == MLX else f"{r.evictions:,}",
        "runs compacted": "-" if r.name == MLX else f"{r.compacted:,}",
        "ended-session tokens held": "-" if r.name == MLX else f"{r.ended_held / r.seeds:,.0f}",
        "wall": f"{r.wall_s:5.1f} s",
    }


def describe(args, model, systems, trace) -> None:
    cost = args.cost
    per_context = sum(c for c, _ in cost.attention)
    lengths: dict[int, int] = {}
    for req in trace:
        lengths[req.conv] = lengths.get(req.conv, len(systems[req.system])) + len(req.new)
        lengths[req.conv] += len(req.reply)
    kv = sum(c.nbytes for c in _probe(model)) // 256  # KVCache holds steps of 256
    longest = max(lengths[s] for s in range(args.sessions)) if args.sessions else 0
    print(
        f"trace{' (1st of ' + str(args.seeds) + ')' if args.seeds > 1 else ''}: "
        f"{len(trace)} requests; {args.sessions} sessions x {args.session_turns} turns "
        f"(final histories up to {longest:,} tokens), {args.chats} chats on {args.systems} "
        f"system prompts of {args.system_tokens}; block size {args.block_size}; "
        f"all final sequences {sum(lengths.values()) * kv / MiB:.1f} MiB of K/V ({kv} B/token)"
    )
    print(
        f"cost model: {cost.per_token / 1e6:.2f} MFLOP/token of weights + "
        f"{per_context:,.0f} FLOP per context token (attention = weights at depth "
        f"{cost.per_token / per_context:,.0f}; x{per_context * 4000 / cost.per_token:.0f} "
        f"at 4,000){'; synthetic K/V (no model run)' if args.synthetic else ''}"
    )


def _probe(model) -> list[Any]:
    cache = make_prompt_cache(model)
    for c in cache:
        c.update_and_fetch(*(mx.zeros((1, 2, 8, 32)),) * 2)
    return cache


def systems_at(args, model, base: CacheConfig) -> list[tuple[str, Callable[[], Any]]]:
    """(name, maker) of each policy, with each ``--run-tokens`` value if given."""
    made = []
    runs = [int(v) for v in args.run_tokens.split(",")] if args.run_tokens else [None]
    for tokens in runs:
        for policy in args.policies.split(","):
            cfg = base.replace(eviction=policy)
            name = policy
            if tokens is not None:
                cfg, name = cfg.replace(hot_run_tokens=tokens), f"{policy} runs {tokens}"
            made.append((name, partial(PrefixCache, model, cfg)))
    return made


def main() -> None:
    args = setup_arg_parser().parse_args()
    width = {"hidden_size": args.hidden, "intermediate_size": args.intermediate}
    heads = {"num_attention_heads": args.heads, "num_key_value_heads": 2, "head_dim": 32}
    model = build_model("llama", seed=args.seed, num_hidden_layers=args.layers, **width, **heads)
    args.cost = RecomputeCost.of(model, _probe(model))
    traces = [make_trace(args, seed) for seed in range(args.seed, args.seed + args.seeds)]
    describe(args, model, *traces[0])
    base = CacheConfig(block_size=args.block_size, hot_cache_only=True, restore_headroom=0)
    rows = []
    for budget in args.budget:
        made = systems_at(args, model, base.replace(hot_max_bytes=budget))
        if args.mlx_lru:
            made.append((MLX, partial(MlxLRU, model, budget)))
        reference = None
        for name, make in made:
            result = Result(name, budget, seeds=args.seeds, synthetic=args.synthetic)
            for systems, trace in traces:
                run(result, make(), model, systems, trace, args)
            reference = reference or result
            rows.append(summary(result, reference))
            print(" | ".join(f"{k} {v.strip()}" for k, v in rows[-1].items()), flush=True)
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
