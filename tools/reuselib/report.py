"""The reference replies, and what each server reached against them.

The reference for a request is the cache-less server's reply to exactly that
request (same messages), computed one request at a time: its answers of the
sequential and probe phases, and a sequential replay of every other request
any server sent (the concurrent phase's, and those whose history differs from
the reference's because a server replied otherwise earlier). The cache-less
server's own concurrent replies are compared too: what batching alone changes.
Each server is judged against the cache-less server of its kind
(``systems.REFERENCE_OF``): vllm-mlx against vllm-mlx without a prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from .systems import REFERENCE, REFERENCE_OF
from .trace import PHASES, PROBES, Chat, Record


def build_reference(
    records: Mapping[str, Sequence[Record]],
    chat: Chat,
    reference: str = REFERENCE,
    served: Collection[str] = (),
) -> dict[str, str]:
    """request key -> the cache-less server ``reference``'s sequential reply
    (``records[reference]`` first, ``chat`` asks it the rest), for every request
    of the servers ``served`` (default: all)."""
    ref = {r.key: r.reply for r in records[reference] if r.phase != "conc" and not r.error}
    for name in served or records:
        for r in records[name]:
            if r.key not in ref:
                reply = chat(json.loads(r.key))
                if not reply.error:
                    ref[r.key] = reply.text
    return ref


@dataclass(slots=True)
class Phase:
    """Totals of one phase; ``valid_cached`` counts cached tokens of right replies only."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    valid_cached: int = 0
    num_differ: int = 0  # replies that differ from the reference
    num_errors: int = 0
    num_overlapped: int = 0  # requests in flight while another of the phase was

    def add(self, r: Record, right: bool) -> None:
        self.num_requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.valid_cached += r.cached_tokens if right else 0
        self.num_differ += 0 if right or r.error else 1
        self.num_errors += 1 if r.error else 0


@dataclass(slots=True)
class Summary:
    """One server on one arch."""

    arch: str
    system: str
    phases: dict[str, Phase] = field(default_factory=lambda: {k: Phase() for k in PHASES})
    probes: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # cached, prompt, right
    failure: str = ""

    @property
    def seq(self) -> Phase:
        return self.phases["seq"]

    @property
    def conc(self) -> Phase:
        return self.phases["conc"]

    @property
    def probe(self) -> Phase:
        return self.phases["probe"]

    @property
    def num_errors(self) -> int:
        return sum(p.num_errors for p in self.phases.values())

    @property
    def total(self) -> Phase:
        """The trace's two phases together (the probes are reported one by one)."""
        t = Phase()
        for p in (self.seq, self.conc):
            t.num_requests += p.num_requests
            t.prompt_tokens += p.prompt_tokens
            t.cached_tokens += p.cached_tokens
            t.valid_cached += p.valid_cached
            t.num_differ += p.num_differ
            t.num_errors += p.num_errors
        return t


def summarize(
    arch: str, system: str, records: Sequence[Record], ref: Mapping[str, str], failure: str = ""
) -> Summary:
    s = Summary(arch, system, failure=failure)
    for r in records:
        right = not r.error and ref.get(r.key) == r.reply
        phase = s.phases[r.phase]
        phase.add(r, right)
        same_phase = (o for o in records if o.phase == r.phase and o is not r)
        phase.num_overlapped += any(r.overlaps(o) for o in same_phase)
        if r.probe:
            s.probes[r.probe] = (r.cached_tokens, r.prompt_tokens, right)
    return s


def _probe(s: Summary, name: str) -> str:
    if name not in s.probes:
        return "-"
    cached, prompt, right = s.probes[name]
    return f"{cached}/{prompt}" + ("" if right else " (wrong)")


def _cached(p: Phase) -> str:
    if p.num_differ == 0:
        return f"{p.cached_tokens}"
    return f"{p.cached_tokens} ({p.valid_cached} valid)"


def summary_line(s: Summary) -> str:
    if s.failure and not s.total.num_requests:
        return f"{s.arch:12} {s.system:13} FAILED: {s.failure}"
    return (
        f"{s.arch:12} {s.system:13} cached seq {s.seq.cached_tokens}/{s.seq.prompt_tokens} "
        f"conc {s.conc.cached_tokens}/{s.conc.prompt_tokens} total {_cached(s.total)} | differ "
        f"seq {s.seq.num_differ}/{s.seq.num_requests} conc {s.conc.num_differ}/"
        f"{s.conc.num_requests} probes {s.probe.num_differ}/{s.probe.num_requests} | conc "
        f"overlapped {s.conc.num_overlapped}/{s.conc.num_requests} | "
        + " ".join(f"{n} {_probe(s, n)}" for n in PROBES[2:])
        + (f" | errors {s.num_errors}" if s.num_errors else "")
        + (f" | {s.failure}" if s.failure else "")
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def headline_table(summaries: Sequence[Summary]) -> str:
    """Per arch: cached tokens summed (seq + conc) of each caching server, ours against
    each peer, replies against each one's reference (the servers in the order they ran)."""
    by_arch: dict[str, dict[str, Summary]] = {}
    for s in summaries:
        by_arch.setdefault(s.arch, {})[s.system] = s
    names = list(dict.fromkeys(s.system for s in summaries))
    caching = [n for n in names if REFERENCE_OF[n] != n]
    peers = [n for n in caching if n != "ours"] if "ours" in names else []
    rows = []
    for arch, systems in by_arch.items():
        total = {n: systems[n].total for n in names}
        rows.append(
            [
                arch,
                *(_cached(total[n]) for n in caching),
                *(_ratio(total["ours"], total[p]) for p in peers),
                " / ".join(str(total[n].prompt_tokens) for n in caching),
                " / ".join(str(total[n].num_differ) for n in names)
                + f" of {total[names[0]].num_requests}",
            ]
        )
    header = (
        "arch",
        *(f"{n} cached" for n in caching),
        *(f"ours / {p}" for p in peers),
        f"prompt tokens ({' / '.join(caching)})",
        f"replies != ref ({' / '.join(names)})",
    )
    return _table(header, rows)


def _ratio(ours: Phase, peer: Phase) -> str:
    return f"{ours.cached_tokens / peer.cached_tokens:.2f}" if peer.cached_tokens else "-"


def detail_table(summaries: Sequence[Summary]) -> str:
    """Per (arch, system): each phase, replies against the reference, the probes."""
    rows = []
    for s in summaries:
        rows.append(
            [
                s.arch,
                s.system,
                f"{s.seq.cached_tokens}/{s.seq.prompt_tokens}",
                f"{s.conc.cached_tokens}/{s.conc.prompt_tokens}",
                f"{s.seq.num_differ} / {s.conc.num_differ} / {s.probe.num_differ}",
                *(_probe(s, n) for n in PROBES[2:]),
                f"{s.conc.num_overlapped}/{s.conc.num_requests}",
                s.failure or str(s.num_errors),
            ]
        )
    header = (
        "arch",
        "server",
        "seq cached/prompt",
        "conc cached/prompt",
        "replies != ref (seq / conc / probe)",
        "next turn",
        "new conv",
        "repeat",
        "conc overlapped",
        "errors",
    )
    return _table(header, rows)


def figure_rows(summaries: Sequence[Summary]) -> list[dict[str, object]]:
    """Per (arch, server): the trace's totals as numbers (``--csv``; tools/plots.py)."""
    return [
        {
            "arch": s.arch,
            "server": s.system,
            "requests": s.total.num_requests,
            "prompt_tokens": s.total.prompt_tokens,
            "cached_tokens": s.total.cached_tokens,
            "valid_cached_tokens": s.total.valid_cached,
            "seq_cached_tokens": s.seq.cached_tokens,
            "conc_cached_tokens": s.conc.cached_tokens,
            "replies_differ": s.total.num_differ,
            "errors": s.num_errors,
            "failure": s.failure,
        }
        for s in summaries
    ]


@dataclass(frozen=True, slots=True)
class ArchResult:
    """One arch's run: every server's summary and records, and what else was counted."""

    arch: str
    summaries: tuple[Summary, ...]
    records: dict[str, list[Record]]
    num_replays: dict[str, int]  # per reference: requests it answered after the trace
    ours_stats: dict[str, int]
    seconds: float
    # vllm-mlx's replies against mlx-lm's cache-less server (not its own): text decoding
    # and mlx-lm 0.31 against 0.32, beside what its cache changes
    vllm_mlx_vs_none: Summary | None = None


def arch_line(result: ArchResult) -> str:
    """The arch's time, the references' replays, ours's counters, vllm-mlx against none."""
    replays = ", ".join(f"{k} {v}" for k, v in result.num_replays.items())
    stats = " ".join(f"{k}={v}" for k, v in result.ours_stats.items())
    line = f"{result.arch}: {result.seconds:.0f} s, reference replays {replays or '-'}"
    if cross := result.vllm_mlx_vs_none:
        line += (
            f"; vllm-mlx replies != none's (mlx-lm's cache-less replies): seq "
            f"{cross.seq.num_differ}/{cross.seq.num_requests} conc {cross.conc.num_differ}/"
            f"{cross.conc.num_requests} probes {cross.probe.num_differ}/{cross.probe.num_requests}"
        )
    return line + (f"; ours at close: {stats}" if stats else "")


def json_result(result: ArchResult) -> dict[str, object]:
    """The arch's result for ``--json``: every request and summary."""
    cross = result.vllm_mlx_vs_none
    return {
        "seconds": result.seconds,
        "num_reference_replays": result.num_replays,
        "ours_close_stats": result.ours_stats,
        "vllm_mlx_vs_none": cross and dataclasses.asdict(cross),
        "summaries": [dataclasses.asdict(s) for s in result.summaries],
        "records": {k: [dataclasses.asdict(r) for r in v] for k, v in result.records.items()},
    }
