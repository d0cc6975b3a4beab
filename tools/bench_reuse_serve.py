"""Prefix reuse through serving: ``prefixcache serve`` against plain ``mlx_lm.server``.

For every tiny ``make-model`` arch, three servers run side by side as real
subprocesses on free loopback ports (tools/reuselib/servers.py): plain
``mlx_lm.server`` (mlx-lm), ``prefixcache serve`` with hot + SSD tiers (ours)
and ``mlx_lm.server --prompt-cache-size 0`` (none: nothing is ever reused, the
reference). Each is driven with the same multi-turn chat trace
(tools/reuselib/trace.py): conversations over shared system prompts one request
at a time, then concurrent clients (mlx-lm's BatchGenerator path), then the
probes (a 2-turn chat's next turn, a new conversation on its system prompt, an
exact repeat). Greedy decoding. Per request: ``usage.prompt_tokens``,
``usage.prompt_tokens_details.cached_tokens`` and the reply, compared with the
cache-less server's reply to the same messages, computed one at a time.

Prints one summary line per (arch, server) and the tables at the end. Timings
are not compared: the three servers share the machine's cores.

    python tools/bench_reuse_serve.py
    python tools/bench_reuse_serve.py --archs llama qwen3_next --turns 4 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from reuselib.report import (
    Summary,
    build_reference,
    detail_table,
    headline_table,
    summarize,
    summary_line,
)
from reuselib.servers import SYSTEMS, Server, start_servers
from reuselib.trace import Chat, Record, TraceConfig, run_trace

from prefixcache.tiny import ARCHS, save_model


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    p.add_argument("--block-size", type=int, default=16, help="prefixcache serve's block size")
    p.add_argument("--conversations", type=int, default=6, help="sequential phase")
    p.add_argument("--turns", type=int, default=3, help="per conversation, both phases")
    p.add_argument("--clients", type=int, default=3, help="concurrent phase: threads")
    p.add_argument("--systems", type=int, default=3, help="shared system prompts")
    p.add_argument("--system-words", type=int, default=260, help="~2.3 tokens a word")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=16, help="generated per request")
    p.add_argument("--seed", type=int, default=0, help="text and model weights")
    p.add_argument(
        "--mlx-lm-args",
        type=shlex.split,
        default=[],
        help="extra options for the plain mlx_lm.server only, e.g. '--prompt-cache-size 100' "
        "(default: none, mlx-lm's defaults)",
    )
    p.add_argument("--json", metavar="OUT", help="save every request and summary here")
    p.add_argument("--workdir", help="keep models, logs and the SSD tier here (default: temp)")
    return p


def trace_config(args: argparse.Namespace) -> TraceConfig:
    for flag in ("conversations", "turns", "clients", "systems", "max_tokens", "block_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, not {getattr(args, flag)}")
    return TraceConfig(
        conversations=args.conversations,
        turns=args.turns,
        clients=args.clients,
        num_systems=args.systems,
        system_words=args.system_words,
        user_words=args.user_words,
        seed=args.seed,
    )


@dataclass(frozen=True, slots=True)
class ArchResult:
    arch: str
    summaries: tuple[Summary, ...]
    records: dict[str, list[Record]]
    num_replays: int  # requests the reference answered after the trace
    ours_stats: dict[str, int]
    seconds: float


def chat_of(server: Server, max_tokens: int) -> Chat:
    return lambda messages: server.chat(messages, max_tokens)


def run_arch(arch: str, args: argparse.Namespace, workdir: Path) -> ArchResult:
    """Start the three servers on a tiny ``arch`` model, drive each, compare, stop them."""
    began = time.perf_counter()
    cfg = trace_config(args)
    model = save_model(workdir / "model", arch, seed=args.seed)
    try:
        servers = start_servers(model, workdir, args.block_size, args.mlx_lm_args)
    except RuntimeError as err:
        summaries = tuple(Summary(arch, s, failure=f"no start: {err}") for s in SYSTEMS)
        return ArchResult(arch, summaries, {}, 0, {}, time.perf_counter() - began)
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = {
                name: pool.submit(run_trace, chat_of(server, args.max_tokens), cfg)
                for name, server in servers.items()
            }
            records = {name: future.result() for name, future in futures.items()}
        reference = build_reference(records, chat_of(servers["none"], args.max_tokens))
        failures = {name: _crash(server) for name, server in servers.items()}
    finally:
        codes = {name: server.stop() for name, server in servers.items()}
    for name, code in codes.items():
        if code not in _CLEAN_EXITS[name] and not failures[name]:
            failures[name] = f"exit status {code} on SIGTERM"
    num_sequential = len({r.key for r in records["none"] if r.phase != "conc" and not r.error})
    return ArchResult(
        arch,
        tuple(summarize(arch, n, records[n], reference, failures[n]) for n in SYSTEMS),
        records,
        len(reference) - num_sequential,
        _close_stats(servers["ours"].text()),
        time.perf_counter() - began,
    )


# mlx_lm.server has no SIGTERM handler; prefixcache serve flushes and exits 0
_CLEAN_EXITS = {"mlx-lm": (0, -signal.SIGTERM), "none": (0, -signal.SIGTERM), "ours": (0,)}


def _crash(server: Server) -> str:
    if server.alive():
        return ""
    return f"exited {server.proc.returncode}: {server.tail()}"


def _close_stats(log: str) -> dict[str, int]:
    """The counters ``prefixcache serve`` logs when it closes its cache."""
    found = re.findall(r"prefixcache: closed cache for .*?: (.*)", log)
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])} if found else {}


def _load() -> str:
    """The machine's 1, 5 and 15 minute load averages (it may be shared)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _json_result(result: ArchResult) -> dict[str, object]:
    return {
        "seconds": result.seconds,
        "num_reference_replays": result.num_replays,
        "ours_close_stats": result.ours_stats,
        "summaries": [dataclasses.asdict(s) for s in result.summaries],
        "records": {k: [dataclasses.asdict(r) for r in v] for k, v in result.records.items()},
    }


def main() -> None:
    parser = setup_arg_parser()
    args = parser.parse_args()
    try:
        trace_config(args)
    except ValueError as err:
        parser.error(str(err))
    command = shlex.join(["python", "tools/bench_reuse_serve.py", *sys.argv[1:]])
    print(
        f"{command}\nmlx-lm {version('mlx-lm')}, mlx {version('mlx')}; {args.conversations} "
        f"conversations over {args.systems} system prompts x {args.turns} turns, then "
        f"{args.clients} concurrent clients x {args.turns} turns; max_tokens {args.max_tokens}, "
        f"block size {args.block_size}; load average {_load()}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_reuse_serve_") as tmp:
        root = Path(args.workdir or tmp)
        for arch in args.archs:
            (root / arch).mkdir(parents=True, exist_ok=True)
            result = run_arch(arch, args, root / arch)
            results.append(result)
            for summary in result.summaries:
                print(summary_line(summary), flush=True)
            stats = " ".join(f"{k}={v}" for k, v in result.ours_stats.items())
            print(
                f"{arch}: {result.seconds:.0f} s, reference replays {result.num_replays}; ours "
                f"at close: {stats or '-'}",
                flush=True,
            )
    summaries = [s for r in results for s in r.summaries]
    print(f"\n{headline_table(summaries)}\n\n{detail_table(summaries)}\n\nload average {_load()}")
    if args.json:
        out = {
            "command": command,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "versions": {p: version(p) for p in ("mlx-lm", "mlx", "prefixcache")},
            "args": vars(args),
            "load_average_at_end": os.getloadavg(),
            "archs": {r.arch: _json_result(r) for r in results},
        }
        Path(args.json).write_text(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
