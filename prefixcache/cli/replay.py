"""``prefixcache replay TRACE``: a request trace through a real model and prompt cache.

Library mode (``--model DIR``, a local mlx-lm model directory): every request
in order through ``PrefixCache`` and through mlx-lm's ``LRUPromptCache`` at
the same bytes (``--hot``; ``--ssd-dir``/``--ssd`` put an SSD tier behind
ours), then ``simulate`` on the same slice and budgets with the model's own
block bytes, so the two hit rates can be compared. Server mode (``--url``):
the trace sent to a running OpenAI-compatible server at its arrival times
(``--speed`` divides them), concurrently as they overlap, as text that the
model's tokenizer (``--model``, the server's model) turns back into the
trace's tokens. Both report
``simulate``'s keys plus ``ttft_p50`` / ``ttft_p90`` / ``ttft_p99`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import os

from ..config import DEFAULT_EVICTION, EVICTIONS
from ..settings import parse_bytes
from .common import EXIT_OK, Args, Command, UsageError
from .report import format_bytes, table

SYSTEMS = ("prefixcache", "mlx-lm")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format JSONL trace")
    p.add_argument(
        "--model", required=True, help="a local mlx-lm model directory (server mode: its tokenizer)"
    )
    p.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block")
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--hot", type=parse_bytes, help="RAM budget of each system (bytes: 64M)")
    p.add_argument("--ssd-dir", help="an SSD tier behind ours (library mode)")
    p.add_argument("--ssd", type=parse_bytes, default=64 << 30, help="its budget")
    p.add_argument(
        "--eviction",
        choices=EVICTIONS,
        default=DEFAULT_EVICTION,
        help=f"our hot eviction (default: the library's, {DEFAULT_EVICTION})",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which of them to run")
    p.add_argument("--speed", type=float, default=1.0, help="server mode: arrivals x SPEED")
    p.add_argument("--max-tokens", type=int, default=1, help="server mode: tokens per reply")
    p.add_argument("--seed", type=int, default=0, help="the token strings' seed")
    p.add_argument("--json", action="store_true", help="one JSON object per system")


def run(args: Args) -> int:
    from ..traces.reader import TraceError, read_trace

    _check(args)
    try:
        requests = read_trace(args.trace, limit=args.limit)
    except TraceError as err:
        raise UsageError(str(err)) from None
    docs = _over_http(args, requests) if args.url else _in_process(args, requests)
    if args.json:
        for doc in docs:
            print(json.dumps(doc))
    else:
        _print(docs)
    return EXIT_OK


def _check(args: Args) -> None:
    if not os.path.isdir(os.path.expanduser(args.model)):
        raise UsageError(f"--model {args.model!r} is not a model directory")
    if args.url is None and args.hot is None:
        raise UsageError("--hot: library mode needs a RAM budget, e.g. --hot 32M")
    for name in ("block_tokens", "limit", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.speed > 0 or args.speed == float("inf"):
        raise UsageError(f"--speed must be a positive number, got {args.speed}")
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            raise UsageError(f"--systems: {name!r} is not one of {', '.join(SYSTEMS)}")


def _in_process(args: Args, requests: list) -> list[dict[str, object]]:
    """Each system in turn, then ``simulate`` on the same slice and budgets."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from ..traces.replay import LibrarySystem, MlxLruSystem, ReplayConfig, replay
    from ..traces.shapes import shape_named
    from ..traces.simulator import SimConfig, Simulation

    path = os.path.expanduser(args.model)
    model, _ = load(path)
    dtype = tree_flatten(model.parameters())[0][1].dtype
    shape = shape_named(path).with_kv_bits(32 if dtype == mx.float32 else 16)
    config = ReplayConfig(
        args.hot, args.ssd_dir, args.ssd, args.block_tokens, args.eviction, args.seed
    )
    docs = []
    for name in args.systems.split(","):
        if name == "prefixcache":
            system = LibrarySystem(model, config, model_id=f"replay:{path}")
        else:
            system = MlxLruSystem(model, args.hot)
        docs.append(replay(requests, model, system, config, shape).as_json())
    ssd = args.ssd if args.ssd_dir else None
    sim = SimConfig(shape, args.hot, ssd, None, args.eviction, block_tokens=args.block_tokens)
    docs.append({"system": "simulate", **Simulation(sim).run(requests).as_json()})
    return docs


def _over_http(args: Args, requests: list) -> list[dict[str, object]]:
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    from ..traces.replay_http import replay_http

    tokenizer = load_tokenizer(Path(os.path.expanduser(args.model)))
    try:
        done = replay_http(
            requests,
            args.url,
            tokenizer,
            block_tokens=args.block_tokens,
            speed=args.speed,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except (OSError, ValueError) as err:
        raise UsageError(f"--url {args.url!r}: {err}") from None
    return [done.as_json()]


def _print(docs: list[dict]) -> None:
    rows = []
    for d in docs:
        ttft = [f"{1000 * d[k]:.0f}" if k in d else "-" for k in ("ttft_p50", "ttft_p90")]
        rows.append(
            [
                d["system"],
                d["requests"],
                f"{100 * d['hit_rate']:.2f}%",
                f"{100 * d['hit_rate_last_half']:.2f}%",
                *ttft,
                format_bytes(d["peak_bytes"]["hot"]),
            ]
        )
    heads = ["system", "requests", "hit rate", "last half", "TTFT p50 ms", "p90 ms", "peak hot"]
    print(table(heads, rows, "lrrrrrr"))


COMMANDS = [
    Command("replay", "replay a request trace through a model and its cache (TTFT)", add_args, run)
]
