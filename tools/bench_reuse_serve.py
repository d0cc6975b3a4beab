"""Prefix reuse through serving: ``prefixcache serve`` against plain ``mlx_lm.server``
and vllm-mlx.

For every tiny ``make-model`` arch, the servers run side by side as real
subprocesses on free loopback ports (tools/reuselib/systems.py): plain
``mlx_lm.server`` (mlx-lm), vllm-mlx's server from ``.venv-vllm-mlx`` when
``make vllm-mlx`` has built it (vllm-mlx), ``prefixcache serve`` with hot + SSD
tiers (ours) and ``mlx_lm.server --prompt-cache-size 0`` (none: nothing is ever
reused, the reference); with vllm-mlx, vllm-mlx without a prefix cache
(vllm-mlx-none: its reference, as its text and model code are not mlx-lm
0.32's). Each is driven with the same multi-turn chat trace
(tools/reuselib/trace.py): conversations over shared system prompts one request
at a time, then concurrent clients (mlx-lm's BatchGenerator path), then the
probes (a 2-turn chat's next turn, a new conversation on its system prompt, an
exact repeat). Greedy decoding. Per request: ``usage.prompt_tokens``,
``usage.prompt_tokens_details.cached_tokens`` (vllm-mlx: from its log's
``[schedule]`` line, tools/reuselib/vllm_mlx.py) and the reply, compared with
the cache-less server's reply to the same messages, computed one at a time
(vllm-mlx's is also compared with none's, printed per arch).

Prints one summary line per (arch, server) and the tables at the end. Timings
are not compared: the servers share the machine's cores.

    python tools/bench_reuse_serve.py
    python tools/bench_reuse_serve.py --archs llama qwen3_next --turns 4 --json out.json
    python tools/bench_reuse_serve.py --servers mlx-lm ours   # without vllm-mlx
    python tools/bench_reuse_serve.py --csv reuse.csv         # totals for tools/plots.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

from benchlib import write_csv
from reuselib import vllm_mlx
from reuselib.report import (
    ArchResult,
    Summary,
    arch_line,
    build_reference,
    detail_table,
    figure_rows,
    headline_table,
    json_result,
    summarize,
    summary_line,
)
from reuselib.servers import Server
from reuselib.systems import (
    REFERENCE,
    REFERENCE_OF,
    SYSTEMS,
    Launch,
    default_systems,
    start_servers,
    with_references,
)
from reuselib.trace import Chat, Record, TraceConfig, run_trace

from prefixcache.tiny.models import ARCHS, save_model


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
    p.add_argument(
        "--servers",
        nargs="+",
        choices=[s for s in SYSTEMS if REFERENCE_OF[s] != s],
        help="the caching servers to compare (the cache-less references always run; "
        "default: mlx-lm, vllm-mlx if `make vllm-mlx` built its venv, ours)",
    )
    p.add_argument(
        "--vllm-mlx-cache-mb",
        type=int,
        default=vllm_mlx.CACHE_MB,
        help=f"vllm-mlx's --cache-memory-mb (default {vllm_mlx.CACHE_MB}: more than the "
        "trace's K/V, never evicts, like mlx-lm's default cache with no byte cap)",
    )
    p.add_argument("--json", metavar="OUT", help="save every request and summary here")
    p.add_argument("--csv", metavar="FILE", help="save the totals per (arch, server) as CSV")
    p.add_argument("--workdir", help="keep models, logs and the SSD tier here (default: temp)")
    return p


def trace_config(args: argparse.Namespace) -> TraceConfig:
    flags = ("conversations", "turns", "clients", "systems", "max_tokens", "block_size")
    for flag in (*flags, "vllm_mlx_cache_mb"):
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


def systems_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The servers to run: those chosen (default: all here), each one's reference, ``none``."""
    return with_references(args.servers or default_systems())


def launch_of(args: argparse.Namespace) -> Launch:
    return Launch(args.block_size, tuple(args.mlx_lm_args), args.vllm_mlx_cache_mb)


def chat_of(server: Server, max_tokens: int) -> Chat:
    return lambda messages: server.chat(messages, max_tokens)


def run_arch(arch: str, args: argparse.Namespace, workdir: Path) -> ArchResult:
    """Start the servers on a tiny ``arch`` model, drive each, compare, stop them."""
    began = time.perf_counter()
    cfg = trace_config(args)
    systems = systems_of(args)
    model = save_model(workdir / "model", arch, seed=args.seed)
    try:
        servers = start_servers(model, workdir, systems, launch_of(args))
    except RuntimeError as err:
        summaries = tuple(Summary(arch, s, failure=f"no start: {err}") for s in systems)
        return ArchResult(arch, summaries, {}, {}, {}, time.perf_counter() - began)
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = {
                name: pool.submit(run_trace, chat_of(server, args.max_tokens), cfg)
                for name, server in servers.items()
            }
            records = {name: future.result() for name, future in futures.items()}
        refs = {
            ref: build_reference(records, chat_of(servers[ref], args.max_tokens), ref, served)
            for ref, served in _served(systems).items()
        }
        failures = {name: _crash(server) for name, server in servers.items()}
    finally:
        codes = {name: server.stop() for name, server in servers.items()}
    for name, code in codes.items():
        if code not in _CLEAN_EXITS[name] and not failures[name]:
            failures[name] = f"exit status {code} on SIGTERM"
    return ArchResult(
        arch,
        tuple(summarize(arch, n, records[n], refs[REFERENCE_OF[n]], failures[n]) for n in systems),
        records,
        {ref: len(refs[ref]) - _num_sequential(records[ref]) for ref in refs},
        _close_stats(servers["ours"].text()) if "ours" in servers else {},
        time.perf_counter() - began,
        summarize(arch, "vllm-mlx", records["vllm-mlx"], refs[REFERENCE])
        if "vllm-mlx" in records
        else None,
    )


def _served(systems: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """reference -> the servers whose requests it answers: ``none`` everyone's (so
    vllm-mlx is also compared with it), a peer's own reference its peer's."""
    served = {ref: tuple(s for s in systems if REFERENCE_OF[s] == ref) for ref in systems}
    return {ref: tuple(systems) if ref == REFERENCE else s for ref, s in served.items() if s}


def _num_sequential(records: Sequence[Record]) -> int:
    return len({r.key for r in records if r.phase != "conc" and not r.error})


# mlx_lm.server has no SIGTERM handler; vllm-mlx shuts down cleanly, then dies of the
# signal (-15); prefixcache serve flushes and exits 0
_CLEAN_EXITS = {
    "mlx-lm": (0, -signal.SIGTERM),
    "vllm-mlx": (0, -signal.SIGTERM),
    "none": (0, -signal.SIGTERM),
    "vllm-mlx-none": (0, -signal.SIGTERM),
    "ours": (0,),
}


def _crash(server: Server) -> str:
    if server.alive():
        return ""
    return f"exited {server.proc.returncode}: {server.tail()}"


def _close_stats(log: str) -> dict[str, int]:
    """The counters ``prefixcache serve`` logs when it closes its cache."""
    found = re.findall(r"prefixcache: closed cache for .*?: (.*)", log)
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])} if found else {}


def _preamble(args: argparse.Namespace) -> str:
    """The versions, the servers (and why vllm-mlx is missing), the trace, the load."""
    systems = systems_of(args)
    peer = ""
    if "vllm-mlx" in systems:
        found = vllm_mlx.versions()
        peer = ", ".join(f"{k} {v}" for k, v in found.items())
        peer = f"; vllm-mlx from {vllm_mlx.VENV.name}: {peer}, cache {args.vllm_mlx_cache_mb} MB"
    elif not args.servers:
        peer = f"\nvllm-mlx SKIPPED: no {vllm_mlx.PYTHON}; build it with `{vllm_mlx.BUILD}`"
    return (
        f"servers {', '.join(systems)}; mlx-lm {version('mlx-lm')}, mlx {version('mlx')}{peer}\n"
        f"{args.conversations} conversations over {args.systems} system prompts x {args.turns} "
        f"turns, then {args.clients} concurrent clients x {args.turns} turns; max_tokens "
        f"{args.max_tokens}, block size {args.block_size}; load average {_load()}"
    )


def _load() -> str:
    """The machine's 1, 5 and 15 minute load averages (it may be shared)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = setup_arg_parser()
    args = parser.parse_args()
    try:
        trace_config(args)
    except ValueError as err:
        parser.error(str(err))
    if "vllm-mlx" in (args.servers or ()) and not vllm_mlx.available():
        parser.error(f"vllm-mlx: no {vllm_mlx.PYTHON}; build it with `{vllm_mlx.BUILD}`")
    command = shlex.join(["python", "tools/bench_reuse_serve.py", *sys.argv[1:]])
    print(f"{command}\n{_preamble(args)}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_reuse_serve_") as tmp:
        root = Path(args.workdir or tmp)
        for arch in args.archs:
            (root / arch).mkdir(parents=True, exist_ok=True)
            result = run_arch(arch, args, root / arch)
            results.append(result)
            for summary in result.summaries:
                print(summary_line(summary), flush=True)
            print(arch_line(result), flush=True)
    summaries = [s for r in results for s in r.summaries]
    print(f"\n{headline_table(summaries)}\n\n{detail_table(summaries)}\n\nload average {_load()}")
    write_csv(args.csv, figure_rows(summaries))
    if args.json:
        out = {
            "command": command,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "versions": {p: version(p) for p in ("mlx-lm", "mlx", "prefixcache")},
            "vllm_mlx_venv_versions": vllm_mlx.versions(),
            "args": vars(args),
            "load_average_at_end": os.getloadavg(),
            "archs": {r.arch: json_result(r) for r in results},
        }
        Path(args.json).write_text(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
