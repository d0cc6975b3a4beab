"""The quiet window: bench_serve's trace through "ours + SSD" with background
writes and promotions waiting out each fetch's window (``background_quiet_ms``,
the default 50) and without (0), against mlx-lm LRU in the same run.

With write_back, every trim spills the blocks it evicts to the SSD tier; the
writer used to start on them at once, beside the prefill of the request just
admitted. On a 2-core CPU that batch (payload files, fsyncs, index commits)
takes cores and the GIL from the prefill. Per system, rounds alternated: TTFT
median and p90 over the trace's requests, their ratio to mlx-lm LRU's in the
same round, and the TTFT median of the requests both cached equally ("same
work": the cache's own cost, free of hit-share differences). "writer busy"
sums the SSD writer's batches that overlapped a request's time to first
token.

    python tools/bench_quiet.py
    python tools/bench_quiet.py --budget 8M --rounds 3
    python tools/bench_quiet.py --write-policy write_through
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import bench_serve
import serve_replay
from bench_serve import MiB, bench_model, make_trace, print_table
from mlx_lm.models.cache import LRUPromptCache
from serve_replay import run

from prefixcache.cli.serve import SERVE_HEADROOM
from prefixcache.config import CacheConfig, parse_bytes
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiers.ssd import writes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget", type=parse_bytes, default=5 * MiB, help="RAM budget (trim_to)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quiet-ms", type=int, default=CacheConfig().background_quiet_ms)
    p.add_argument("--write-policy", choices=["write_back", "write_through"], default="write_back")
    args = p.parse_args()
    bargs = bench_serve.setup_arg_parser().parse_args(["--budget", str(args.budget)])
    model = bench_model(bargs)
    systems, trace = make_trace(bargs)
    busy = _watch_writer()
    windows: list[tuple[float, float, int]] = []
    serve_replay.serve = _timed(serve_replay.serve, windows)
    base = CacheConfig(
        block_size=bargs.block_size,
        restore_headroom=SERVE_HEADROOM,
        write_policy=args.write_policy,
    )
    print(
        f"trace: {len(trace)} requests, budget {args.budget / MiB:.1f} MiB, block 32, "
        f"{args.write_policy}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            results = {}
            runs = [
                ("mlx-lm LRU", None),
                ("+SSD, no window", 0),
                (f"+SSD, window {args.quiet_ms} ms", args.quiet_ms),
            ]
            for name, quiet_ms in runs:
                if quiet_ms is None:
                    make = lambda: LRUPromptCache(max_size=1 << 20)  # noqa: E731
                else:
                    cfg = base.replace(ssd_dir=f"{tmp}/{round_}-{quiet_ms}")
                    cfg = cfg.replace(background_quiet_ms=quiet_ms)
                    make = lambda cfg=cfg: TieredPromptCache(lambda key: model, cfg)  # noqa: E731
                windows.clear()
                busy.clear()
                result = run(name, args.budget, make, model, systems, trace, bargs)
                results[name] = (result, list(windows), list(busy))
            rows += _rows(round_, results)
    print()
    print_table(rows)


def _timed(serve_one, windows: list[tuple[float, float, int]]):
    """bench_serve's ``serve``, noting each request's (start, first token, cached)."""

    def serve(cache, gen, prompt, sys_end, args, result):
        start = time.perf_counter()
        out, num_cached = serve_one(cache, gen, prompt, sys_end, args, result)
        windows.append((start, start + result.ttfts[-1], num_cached))
        return out, num_cached

    return serve


def _watch_writer() -> list[tuple[float, float]]:
    """The SSD writer's batches as (start, end) times, appended as they finish."""
    spans: list[tuple[float, float]] = []
    write_batch = writes.SsdWrites.write_batch

    def timed(self, items):
        start = time.perf_counter()
        try:
            write_batch(self, items)
        finally:
            spans.append((start, time.perf_counter()))

    writes.SsdWrites.write_batch = timed
    return spans


def _rows(round_: int, results: dict) -> list[dict[str, str]]:
    ref, ref_windows, _ = results["mlx-lm LRU"]
    ref_p50 = statistics.median(ref.ttfts)
    ref_p90 = statistics.quantiles(ref.ttfts, n=10)[-1]
    rows = []
    for name, (r, windows, spans) in results.items():
        p50, p90 = statistics.median(r.ttfts), statistics.quantiles(r.ttfts, n=10)[-1]
        # requests both caches restored equally: the cache's own cost per request
        same = [
            (t, ref.ttfts[i]) for i, t in enumerate(r.ttfts) if windows[i][2] == ref_windows[i][2]
        ]
        overlap = sum(max(0.0, min(b, we) - max(a, ws)) for ws, we, _ in windows for a, b in spans)
        rows.append(
            {
                "round": str(round_ + 1),
                "system": name,
                "cached/prompt": f"{r.cached_tokens / r.prompt_tokens:6.1%}",
                "TTFT p50": f"{p50 * 1e3:6.1f} ms",
                "TTFT p90": f"{p90 * 1e3:6.1f} ms",
                "p50 / mlx-lm": f"{p50 / ref_p50:5.2f}",
                "p90 / mlx-lm": f"{p90 / ref_p90:5.2f}",
                "same work p50": f"{statistics.median(t for t, _ in same) * 1e3:6.1f} ms"
                f" / {statistics.median(t for _, t in same) * 1e3:6.1f} ({len(same)})",
                "writer busy": f"{overlap * 1e3:7.1f} ms" if spans else "-",
                "same tokens": "ref" if r is ref else str(r.outputs == ref.outputs),
            }
        )
    return rows


if __name__ == "__main__":
    main()
