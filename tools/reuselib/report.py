"""The reference replies, and what each server reached against them.

The reference for a request is the cache-less server's reply to exactly that
request (same messages), computed one request at a time: its answers of the
sequential and probe phases, and a sequential replay of every other request
any server sent (the concurrent phase's, and those whose history differs from
the reference's because a server replied otherwise earlier). The cache-less
server's own concurrent replies are compared too: what batching alone changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .trace import PHASES, PROBES, Chat, Record


def build_reference(records: Mapping[str, Sequence[Record]], chat: Chat) -> dict[str, str]:
    """request key -> the cache-less server's sequential reply (``records["none"]`` first)."""
    ref = {r.key: r.reply for r in records["none"] if r.phase != "conc" and not r.error}
    for system_records in records.values():
        for r in system_records:
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
        return f"{s.arch:12} {s.system:7} FAILED: {s.failure}"
    return (
        f"{s.arch:12} {s.system:7} cached seq {s.seq.cached_tokens}/{s.seq.prompt_tokens} "
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
    """Per arch: cached tokens summed (seq + conc), mlx-lm against ours, replies against ref."""
    by_arch: dict[str, dict[str, Summary]] = {}
    for s in summaries:
        by_arch.setdefault(s.arch, {})[s.system] = s
    rows = []
    for arch, systems in by_arch.items():
        mlx, ours, none = (systems[k].total for k in ("mlx-lm", "ours", "none"))
        ratio = f"{ours.cached_tokens / mlx.cached_tokens:.2f}" if mlx.cached_tokens else "-"
        rows.append(
            [
                arch,
                _cached(mlx),
                _cached(ours),
                ratio,
                f"{mlx.prompt_tokens} / {ours.prompt_tokens}",
                f"{mlx.num_differ} / {ours.num_differ} / {none.num_differ} of {mlx.num_requests}",
            ]
        )
    header = (
        "arch",
        "mlx-lm cached",
        "ours cached",
        "ours / mlx-lm",
        "prompt tokens (mlx-lm / ours)",
        "replies != ref (mlx-lm / ours / none)",
    )
    return _table(header, rows)


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
