"""Multi-turn serving benchmark: mlx-lm's LRUPromptCache vs TieredPromptCache.

Replays one multi-turn trace (conversations over a few shared system prompts,
growing histories, a window of active conversations interleaved at random, a
restart in the middle) through each prompt cache, driven the way mlx-lm
0.32.2's server drives it on its batch path: ``fetch_nearest_cache``, then a
``BatchGenerator`` prefilling the system / user segments with a cache insert
at each segment end and at the end of generation, and
``trim_to(n_bytes=budget - active)`` after each admission (as
``--prompt-cache-bytes`` does). Real prefill and greedy decoding on a small
random-weight llama, in process. Systems, at each RAM budget (``--budget``):

  mlx-lm LRU     LRUPromptCache (RAM only, whole sequences) as the server makes it:
                 the budget is applied by trim_to only, so inserts overshoot it
  ours hot-only  TieredPromptCache(hot_cache_only=True) as ``prefixcache serve
                 --prompt-cache-bytes`` makes it: the same rule (hot_max_bytes
                 its default, the budget applied by trim_to only); adaptive
                 eviction (the default: cost's order until it has measured reuse)
  hot-only LRU   the same with eviction="lru" (leaves first, least recently used)
  ours + SSD     the same with an SSD tier (write_back; closed and reopened at
                 the restart, as ``prefixcache serve`` does on SIGTERM)
  LRU strict     LRUPromptCache(max_bytes=budget): enforced at every insert too
  ours strict    hot-only with hot_max_bytes=budget: enforced at every insert too
  strict LRU     the same with eviction="lru"

mlx-lm's batch merges a fetched cache into a new buffer, and its first prefill
step copies that into one with room for the step; ours is restored with room
for the prompt's rest and its first token, which the batch takes as its own
buffer (prefixcache/serve/batch.py): the restore's gather is its only copy.

"recompute GFLOP" sums the FLOPs of the prompt tokens each system prefilled
(prefixcache/cache/costs.py: weights plus attention over the tokens before each), the
work its evictions left to redo, free of timing noise.

Per system: cached / prompt tokens, prefill tokens computed, time to first
token (median, p90, and summed: the time spent recomputing what was not
cached), peak bytes the cache held in RAM, the cached share of the
first request of each conversation resumed after the restart, and whether the
generated tokens equal mlx-lm LRU's. Timings are of a 2-core CPU shared with
whatever else runs: compare systems within one run. Each budget replays the
trace ``--rounds`` times per system, in the systems' order then in reverse
(ABBA: a drift of the machine's speed, and whichever system runs first after a
warm-up, weigh on all alike); the TTFTs are pooled over rounds and the
"p50 / LRU" column divides each system's median by mlx-lm LRU's. "paired": the
median over requests of each request's TTFT over mlx-lm LRU's for the same
request of the same round. With ``--lockstep`` the systems take the trace
request by request instead (the first to serve each request rotating), so a
drift of the machine's speed falls on every system's copy of a request alike;
each request of ours is followed by a flush of its SSD writes (outside the
timings, so none lands in another system's), which the one-after-another
replays charge to ours' own next requests. "fetch p50": the median time of
``fetch_nearest_cache`` (part of the TTFT). "wall": a system's own replay time
per round (in lockstep, its steps only).

    python tools/bench_serve.py [--lockstep]
    python tools/bench_serve.py --conversations 32 --turns 8 --budget 16M
    python tools/bench_serve.py --lockstep --csv serve.csv
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from operator import truediv

from benchlib import add_csv_arg, add_trace_args, arrivals, chat_model_shape, write_csv
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from serve_replay import Result, lockstep, pooled, replay, run

from prefixcache.cache.costs import RecomputeCost
from prefixcache.cli.serve import SERVE_HEADROOM
from prefixcache.config import CacheConfig, parse_bytes
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiny.models import build_model

MiB = 1 << 20


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument(
        "--budget", type=parse_bytes, nargs="+", default=[3 * MiB, 5 * MiB, 8 * MiB, 16 * MiB]
    )
    p.add_argument("--ssd-dir", default=None, help="SSD tier directory (default: a temp dir)")
    add_csv_arg(p)
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="replay the systems request by request (each request's first system rotating)"
        " instead of one after another; background SSD writes are waited for after each",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a CacheConfig field of ours, as its PREFIXCACHE_* variable takes it (repeat):"
        " e.g. explain_header=false, events_url=tcp://127.0.0.1:5599",
    )
    return p


def config_env(pairs: list[str]) -> dict[str, str]:
    """``--config`` pairs as ``PREFIXCACHE_*`` variables; a pair without ``=`` exits."""
    env = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field:
            raise SystemExit(f"bench_serve: --config {pair!r} is not FIELD=VALUE")
        env[f"PREFIXCACHE_{field.upper()}"] = value
    return env


@dataclass(frozen=True, slots=True)
class Turn:
    conv: int
    turn: int
    system: int
    user: list[int]


def make_trace(args: argparse.Namespace) -> tuple[list[list[int]], list[Turn]]:
    """(system prompts, turns in arrival order) from ``args.seed``."""
    rng = random.Random(args.seed)
    tokens = lambda n: [rng.randrange(1, 500) for _ in range(n)]  # noqa: E731
    systems = [tokens(args.system_tokens) for _ in range(args.systems)]
    order = arrivals(rng, args.conversations, args.turns, args.active)  # lazy: same draws
    return systems, [Turn(c, t, c % args.systems, tokens(args.user_tokens)) for c, t in order]


def _round_of(systems_run, r: int, budget: int, model, systems, trace, args) -> list[Result]:
    """Round ``r`` of every system: one after another (the order reversed in odd
    rounds), or, with ``--lockstep``, request by request."""
    if args.lockstep:
        steps = [
            replay(name, budget, partial(make, r), model, systems, trace, args)
            for name, make in systems_run
        ]
        return lockstep(steps, reverse=r % 2 == 1)
    order = systems_run if r % 2 == 0 else systems_run[::-1]
    return [run(n, budget, partial(make, r), model, systems, trace, args) for n, make in order]


def _round(cfg: CacheConfig, r: int) -> CacheConfig:
    return cfg.replace(ssd_dir=f"{cfg.ssd_dir}-{r}")  # a fresh SSD tier each round


def figures(r: Result, reference: Result, rounds: int = 1) -> dict[str, object]:
    """A table row's figures as numbers; counts per replay (``rounds`` pooled in ``r``)."""
    p50 = statistics.median(r.ttfts)
    return {
        "budget_mib": r.budget / MiB,
        "system": r.name,
        "rounds": rounds,
        "cached_share": r.cached_tokens / r.prompt_tokens,
        "prefill_tokens": (r.prompt_tokens - r.cached_tokens) // rounds,
        "ttft_p50_ms": p50 * 1e3,
        "p50_ratio": p50 / statistics.median(reference.ttfts),
        "paired": statistics.median(map(truediv, r.ttfts, reference.ttfts)),
        "ttft_p90_ms": statistics.quantiles(r.ttfts, n=10)[-1] * 1e3,
        "fetch_p50_ms": statistics.median(r.fetches) * 1e3,
        "ttft_sum_s": sum(r.ttfts) / rounds,
        "recompute_gflop": r.recompute_flops / 1e9 / rounds,
        "peak_cache_mib": r.peak_bytes / MiB,
        "after_restart": r.resumed_cached / r.resumed_prompt if r.resumed_prompt else 0.0,
        "same_tokens": "ref" if r is reference else r.outputs == reference.outputs,
        "wall_s": r.seconds / rounds,
    }


def summary(f: dict[str, object]) -> dict[str, str]:
    """A printed table row of ``figures``."""
    return {
        "budget": f"{f['budget_mib']:.1f} MiB",
        "system": f["system"],
        "cached/prompt": f"{f['cached_share']:6.1%}",
        "prefill tokens": f"{f['prefill_tokens']:,}",
        "TTFT p50": f"{f['ttft_p50_ms']:7.1f} ms",
        "p50 / LRU": f"{f['p50_ratio']:5.2f}",
        "paired": f"{f['paired']:5.3f}",
        "TTFT p90": f"{f['ttft_p90_ms']:7.1f} ms",
        "fetch p50": f"{f['fetch_p50_ms']:5.2f} ms",
        "TTFT sum": f"{f['ttft_sum_s']:6.2f} s",
        "recompute GFLOP": f"{f['recompute_gflop']:7.1f}",
        "peak cache RAM": f"{f['peak_cache_mib']:6.2f} MiB",
        "after restart": f"{f['after_restart']:6.1%}",
        "same tokens": str(f["same_tokens"]),
        "wall": f"{f['wall_s']:5.1f} s",
    }


def print_table(rows: list[dict[str, str]]) -> None:
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(row[k].ljust(w) for k, w in widths.items()))


def bench_model(args: argparse.Namespace):
    """The trace's model (a 4-layer llama of width ``--hidden``); sets ``args.cost``."""
    model = build_model("llama", seed=args.seed, **chat_model_shape(args.hidden))
    args.cost = RecomputeCost.of(model, make_prompt_cache(model))
    return model


def main() -> None:
    args = setup_arg_parser().parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each round's line as it ends
    model = bench_model(args)
    systems, trace = make_trace(args)
    print(f"trace: {args.conversations} conversations x {args.turns} turns ({len(trace)} "
          f"requests), {args.systems} system prompts of {args.system_tokens} tokens, "
          f"{args.active} active, restart after request {len(trace) // 2}; "
          f"block size {args.block_size}")  # fmt: skip
    # MLX's first calls (allocations, kernels) are not any system's cost
    run("warm-up", 0, lambda: LRUPromptCache(max_size=1 << 20), model, systems, trace[:4], args)
    results = []
    # as ``prefixcache serve`` sets it: restore_headroom SERVE_HEADROOM (the batch takes
    # the restored buffer), hot_max_bytes its default (the budget is
    # --prompt-cache-bytes: trim_to)
    hot = CacheConfig.from_env(
        config_env(args.config),
        block_size=args.block_size,
        hot_cache_only=True,
        restore_headroom=SERVE_HEADROOM,
    )
    lru = hot.replace(eviction="lru")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budget:
            strict = hot.replace(hot_max_bytes=budget)
            strict_lru = strict.replace(eviction="lru")
            ssd = hot.replace(hot_cache_only=False, ssd_dir=f"{args.ssd_dir or tmp}/{budget}")
            systems_run = [
                ("mlx-lm LRU", lambda r: LRUPromptCache(max_size=1 << 20)),
                ("ours hot-only", lambda r: TieredPromptCache(lambda key: model, hot)),
                ("hot-only LRU", lambda r: TieredPromptCache(lambda key: model, lru)),
                ("ours + SSD", lambda r, c=ssd: TieredPromptCache(lambda key: model, _round(c, r))),
                ("LRU strict", lambda r, b=budget: LRUPromptCache(max_size=1 << 20, max_bytes=b)),
                ("ours strict", lambda r, c=strict: TieredPromptCache(lambda key: model, c)),
                ("strict LRU", lambda r, c=strict_lru: TieredPromptCache(lambda key: model, c)),
            ]
            rounds: dict[str, list[Result]] = {name: [] for name, _ in systems_run}
            for r in range(args.rounds):
                for result in _round_of(systems_run, r, budget, model, systems, trace, args):
                    rounds[result.name].append(result)
                    p50 = statistics.median(result.ttfts) * 1e3
                    print(f"{budget / MiB:.1f} MiB round {r} {result.name}: TTFT p50 {p50:.1f} ms")
            reference = pooled(rounds["mlx-lm LRU"])
            for name, _ in systems_run:
                result = reference if name == "mlx-lm LRU" else pooled(rounds[name])
                results.append((result, reference))
    print()
    rows = [figures(r, ref, args.rounds) for r, ref in results]
    print_table([summary(f) for f in rows])
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
