"""bench_serve's multi-turn chats through real servers, from outside: time to first
token at equal RAM against plain ``mlx_lm.server`` and vllm-mlx.

The same trace as ``bench_serve.py`` (conversations over a few shared system
prompts, growing histories, a window of active conversations interleaved at
random, a restart in the middle; one request at a time, streamed, greedy) goes
to each system as a real subprocess on a saved copy of bench_serve's model (a
4-layer random-weight llama of width ``--hidden``, with the tiny tokenizer).
Each (system, round) starts a fresh server alone on the machine (no two run at
once, but with ``--lockstep``: below), replays the whole trace, stopping it
(SIGTERM) and starting it again on the same directory halfway, and stops; rounds
alternate the systems' order (ABBA).
Systems, each held to ``--budget`` bytes of cache in RAM:

  mlx-lm          ``mlx_lm.server --prompt-cache-bytes B`` (its LRUPromptCache)
  ours hot-only   ``prefixcache serve --hot-cache-only --prompt-cache-bytes B``
  ours + SSD      ``prefixcache serve --prompt-cache-bytes B`` with an SSD tier
  vllm-mlx        ``vllm-mlx serve --continuous-batching --cache-memory-mb B``
                  in its own venv (``make vllm-mlx``); skipped, and said so,
                  when the venv is missing

Per system: TTFT median and p90 (pooled over rounds; a request's TTFT is from
sending it to the first streamed content), their ratios to mlx-lm's, the
cached share of prompt tokens (the servers' ``usage``; vllm-mlx's cached tokens
from its log), the cached share of the first request of each conversation
resumed after the restart, and whether its replies equal mlx-lm's (as the
history holds them: without surrounding blanks and U+FFFD, which the servers
stream differently).

"paired": the median over requests of each request's TTFT over mlx-lm's for the
same request of the same round. With ``--lockstep`` every server is up at once
and each request goes to each in turn (the first rotating, the order reversed
in odd rounds); after its request a server is left to settle (its CPU time
still for 30 ms) before the next one's, so no server's background work lands
in another's timing, and a drift of the machine's speed falls on all alike.

    python tools/bench_serve_http.py [--lockstep]
    python tools/bench_serve_http.py --budget 3M 8M --rounds 2
    python tools/bench_serve_http.py --lockstep --budget 3M 5M 8M 16M --csv serve_http.csv
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from operator import truediv
from pathlib import Path

from benchlib import add_csv_arg, add_trace_args, arrivals, chat_model_shape, write_csv
from reuselib import vllm_mlx
from reuselib.servers import Server
from reuselib.trace import Text
from serve_replay import finish, lockstep

from prefixcache.config import parse_bytes
from prefixcache.tiny.models import save_model

MiB = 1 << 20
SYSTEMS = ("mlx-lm", "ours hot-only", "ours + SSD", "vllm-mlx")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p)
    p.add_argument("--system-words", type=int, default=170, help="about 384 tokens")
    p.add_argument("--user-words", type=int, default=20, help="about 48 tokens")
    p.add_argument("--budget", type=parse_bytes, nargs="+", default=[3 * MiB, 8 * MiB])
    p.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    add_csv_arg(p)
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="every server up at once, each request sent to each in turn (the first "
        "rotating), each server settling after its request; a 'paired' column",
    )
    return p


def make_trace(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(conversation, turn) in arrival order: bench_serve's (its system prompt is
    conversation % ``--systems``)."""
    return list(arrivals(random.Random(args.seed), args.conversations, args.turns, args.active))


@dataclass(slots=True)
class Result:
    system: str
    budget: int
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replies: list[str] = field(default_factory=list)
    resumed_prompt: int = 0  # first request of each conversation resumed after the restart
    resumed_cached: int = 0


def start(system: str, model: Path, workdir: Path, budget: int, args, keep: bool) -> Server:
    """A server of ``system`` (not yet ready) holding ``budget`` bytes of cache; ``keep``:
    a restart, on what the last one left in ``workdir`` (SSD tier, vllm-mlx's saved cache)."""
    if system == "vllm-mlx":
        return vllm_mlx.VllmMlxServer(system, model, workdir, max(1, budget // MiB), keep=keep)
    ours = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
    ours += ["--block-size", str(args.block_size), "--prompt-cache-bytes", str(budget)]
    argv = {
        "mlx-lm": [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                   "--prompt-cache-bytes", str(budget)],
        "ours hot-only": [*ours, "--hot-cache-only"],
        "ours + SSD": [*ours, "--ssd-dir", str(workdir / "ssd")],
    }[system]  # fmt: skip
    return Server(system, argv, workdir / "server.log")


def replay(
    system: str, budget: int, model: Path, trace: list[tuple[int, int]], text: Text, args
) -> Result:
    """A fresh server of ``system`` through the whole trace (``make_trace``), restarted
    halfway (stopped by SIGTERM, started again on the same directory)."""
    return finish(steps(system, budget, model, trace, text, args))


def steps(system: str, budget: int, model: Path, trace: list[tuple[int, int]], text: Text, args):
    """``replay`` one request per ``next`` (returns the Result as StopIteration's value).
    With ``--lockstep`` each request is followed by the server settling (its
    background work done, outside the timings: none lands in another's)."""
    result = Result(system, budget)
    restart_at, resumed = len(trace) // 2, set()
    with tempfile.TemporaryDirectory() as tmp:
        server = start(system, model, Path(tmp), budget, args, keep=False)
        try:
            server.wait_ready()
            histories: dict[int, list[dict[str, str]]] = {}
            for i, (conv, turn) in enumerate(trace):
                if i == restart_at:
                    server.stop()
                    server = start(system, model, Path(tmp), budget, args, keep=True)
                    server.wait_ready()
                    resumed = set(histories)
                system_prompt = text.system(conv % args.systems, args.system_words)
                messages = histories.setdefault(
                    conv, [{"role": "system", "content": system_prompt}]
                )
                user = text.user(conv, turn, args.user_words)
                messages.append({"role": "user", "content": user})
                got = server.stream(messages, args.max_tokens, usage=True)
                # the servers' streams differ in a reply's leading space and in how many
                # U+FFFD stand for a random model's broken UTF-8: without both, the same
                # tokens make the same next prompt
                reply = got.text.replace("\ufffd", "").strip()
                messages.append({"role": "assistant", "content": reply})
                result.ttfts.append(got.first)
                result.replies.append(reply)
                result.prompt_tokens += got.prompt_tokens
                result.cached_tokens += got.cached_tokens
                if conv in resumed:
                    resumed.discard(conv)
                    result.resumed_prompt += got.prompt_tokens
                    result.resumed_cached += got.cached_tokens
                if getattr(args, "lockstep", False):
                    server.settle()
                yield
        finally:
            server.stop()
    return result


def main() -> None:
    args = setup_arg_parser().parse_args()
    systems = [s for s in args.only if s != "vllm-mlx" or vllm_mlx.available()]
    if "vllm-mlx" in args.only and "vllm-mlx" not in systems:
        print(f"vllm-mlx SKIPPED: no {vllm_mlx.PYTHON} (build it with `{vllm_mlx.BUILD}`)")
    trace = make_trace(args)
    text = Text(args.seed)
    rows, figures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(
            Path(tmp) / "model", "llama", seed=args.seed, **chat_model_shape(args.hidden)
        )
        print(f"trace: {len(trace)} requests; systems: {', '.join(systems)}", flush=True)
        for budget in args.budget:
            rounds: dict[str, list[Result]] = {s: [] for s in systems}
            for r in range(args.rounds):
                order = systems if r % 2 == 0 else systems[::-1]
                if args.lockstep:  # every server up at once, each request to each in turn
                    made = [steps(x, budget, model, trace, text, args) for x in systems]
                    done = lockstep(made, reverse=r % 2 == 1)
                else:
                    done = [replay(x, budget, model, trace, text, args) for x in order]
                for res in done:
                    rounds[res.system].append(res)
                    print(f"{budget / MiB:.1f} MiB round {r} {res.system}: TTFT p50 "
                          f"{statistics.median(res.ttfts) * 1e3:.1f} ms", flush=True)  # fmt: skip
            measured = measures(budget, rounds)
            rows += [table_row(m) for m in measured]
            figures += measured
    print()
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(row[k].ljust(w) for k, w in widths.items()))
    write_csv(args.csv, figures)


def measures(budget: int, rounds: dict[str, list[Result]]) -> list[dict[str, object]]:
    """Per system at ``budget``: the table's figures as numbers (ratios to mlx-lm's are
    empty without mlx-lm)."""
    ref = rounds.get("mlx-lm")
    ref_ttfts = [t for r in ref for t in r.ttfts] if ref else []
    rows = []
    for system, results in rounds.items():
        ttfts = [t for r in results for t in r.ttfts]
        p50, p90 = statistics.median(ttfts), statistics.quantiles(ttfts, n=10)[-1]
        prompt = sum(r.prompt_tokens for r in results)
        resumed = sum(r.resumed_prompt for r in results)
        rows.append({
            "budget_mib": budget / MiB,
            "system": system,
            "rounds": len(results),
            "requests": len(ttfts),
            "cached_share": sum(r.cached_tokens for r in results) / prompt if prompt else "",
            "ttft_p50_ms": p50 * 1e3,
            "p50_ratio": p50 / statistics.median(ref_ttfts) if ref else "",
            "paired": statistics.median(map(truediv, ttfts, ref_ttfts)) if ref else "",
            "ttft_p90_ms": p90 * 1e3,
            "p90_ratio": p90 / statistics.quantiles(ref_ttfts, n=10)[-1] if ref else "",
            "after_restart": sum(r.resumed_cached for r in results) / resumed if resumed else "",
            "same_replies": "ref" if system == "mlx-lm" else ref is not None
            and all(r.replies == ref[0].replies for r in results),
        })  # fmt: skip
    return rows


def _number(value: object, spec: str, unit: str = "") -> str:
    return "-" if value == "" else f"{value:{spec}}{unit}"


def table_row(m: dict[str, object]) -> dict[str, str]:
    """One printed row of ``measures``' figures."""
    return {
        "budget": f"{m['budget_mib']:.1f} MiB",
        "system": m["system"],
        "cached/prompt": _number(m["cached_share"], "6.1%"),
        "TTFT p50": f"{m['ttft_p50_ms']:7.1f} ms",
        "p50 / mlx-lm": _number(m["p50_ratio"], "5.2f"),
        "paired": _number(m["paired"], "5.3f"),
        "TTFT p90": f"{m['ttft_p90_ms']:7.1f} ms",
        "p90 / mlx-lm": _number(m["p90_ratio"], "5.2f"),
        "after restart": _number(m["after_restart"], "6.1%"),
        "same replies": str(m["same_replies"]),
    }


if __name__ == "__main__":
    main()
