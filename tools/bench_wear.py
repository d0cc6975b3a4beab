"""SSD wear: bytes written and hit share with ``ssd_admit_after`` 1 vs 2 and a write budget.

One seeded trace, served by a real PrefixCache per configuration in one run: a
shared system prompt, ``--conversations`` multi-turn chats (each turn's prompt
is the previous turn's prompt and reply plus a new user message; interleaved)
and ``--one-offs`` prompts seen once (half start with the system prompt, half
share nothing): an agent's sub-calls, a batch job's single requests. Each
request is ``fetch`` (its cached tokens count as hits) then ``store`` of the
prompt and its reply, as a server does after generating. The K/V values are
the tiny llama's (``prefixcache.tiny.models``), computed once per sequence before the
runs: every configuration stores the same bytes, and only the cache differs.

Policy: ``write_back`` (the default) with a hot tier of ``--hot-blocks``
blocks, well below the trace's working set, so blocks spill to SSD all along;
the SSD tier is large enough never to evict. Under write_back a block is
written when hot evicts it: a one-off's blocks are written (admit 1) or
dropped (admit 2: seen once), a conversation's blocks are written once their
next turn has restored them (the second sighting). ``--policy write_through``
writes at store time instead (admit 2 then writes a block at its second
sighting, while it is still hot).

Configurations: ``hot only`` (no SSD tier: the hit share the SSD tier adds is
the difference), ``admit 1`` (the reference: every block written), ``admit 2``,
``admit 1 + budget`` and ``admit 2 + budget`` (``--budget-share`` of the bytes
``admit 1`` wrote, per day; the run lasts seconds, so the bucket barely drains).

    python tools/bench_wear.py [--conversations 24 --turns 6 --one-offs 160 --hot-blocks 48]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import build_model

BLOCK = 16
VOCAB = 512


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    stored: list[int]  # prompt + reply: what the server stores after generating
    seq: int  # the sequence whose cache holds ``stored`` as a prefix
    kind: str  # "turn" or "one-off"


def make_trace(args: argparse.Namespace) -> tuple[list[Request], list[list[int]]]:
    """Requests in serving order, and every sequence (a chat's last turn or a one-off).

    Chats come in visits of ``--turns-per-visit`` turns; ``--active`` visits are
    in flight at once (their turns interleaved, one-offs falling between them);
    a chat's next visit comes back after the visits of ``--pause`` other chats
    have started (long enough for the hot tier to have evicted it).
    """
    rng = np.random.default_rng(args.seed)

    def words(lo: int, hi: int) -> list[int]:
        return rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1))).tolist()

    system = words(args.system_tokens, args.system_tokens)
    chats, seqs = [], []
    for _ in range(args.conversations):
        history, turns = list(system), []
        for _ in range(args.turns):
            prompt = history + words(16, 48)
            history = prompt + words(16, 48)
            turns.append(Request(prompt, history, len(seqs), "turn"))
        seqs.append(history)
        per = args.turns_per_visit
        chats.append([turns[i : i + per] for i in range(0, len(turns), per)])
    singles = []
    for i in range(args.one_offs):
        prompt = (system if i % 2 == 0 else []) + words(32, 128)
        stored = prompt + words(8, 32)
        singles.append(Request(prompt, stored, len(seqs), "one-off"))
        seqs.append(stored)
    return _interleave(rng, _visits(chats, args.pause), singles, args.active), seqs


def _visits(chats: list[list[list[Request]]], pause: int) -> list[list[Request]]:
    """Every chat's visits in starting order: visit v of chat c after the first visits
    of the ``pause`` chats after it."""
    slots = sorted(
        ((c + v * (pause + 1), v, c) for c, visits in enumerate(chats) for v in range(len(visits)))
    )
    return [chats[c][v] for _, v, c in slots]


def _interleave(rng, visits, singles, active: int) -> list[Request]:
    """``active`` visits in flight, a random one's next turn at each step, one-offs
    spread evenly between the turns."""
    num_turns = sum(len(v) for v in visits)
    every = num_turns / max(1, len(singles))
    queue, running, trace, done = list(visits), [], [], 0
    while queue or running:
        while queue and len(running) < active:
            running.append(list(queue.pop(0)))
        visit = running[int(rng.integers(len(running)))]
        trace.append(visit.pop(0))
        running = [v for v in running if v]
        done += 1
        while singles and done >= every * (len(trace) - done + 1):
            trace.append(singles.pop())
    return trace + singles


def sequence_caches(model, seqs: list[list[int]]) -> list[list[KVCache]]:
    """The model's cache of every sequence (computed once, shared by the runs)."""
    out = []
    for tokens in seqs:
        cache = make_prompt_cache(model)
        for start in range(0, len(tokens), 256):
            model(mx.array([tokens[start : start + 256]]), cache=cache)
        mx.eval([c.state for c in cache])
        out.append(cache)
    return out


def prefix_of(cache: list[KVCache], n: int) -> list[KVCache]:
    """A cache holding the first ``n`` tokens of ``cache`` (copies)."""
    out = []
    for layer in cache:
        c = KVCache()
        c.update_and_fetch(mx.array(layer.keys[..., :n, :]), mx.array(layer.values[..., :n, :]))
        out.append(c)
    return out


def serve(model, trace, caches, cfg: CacheConfig) -> dict[str, float]:
    """Serve the trace; bytes written, hit share (cached / prompt tokens), counters."""
    began = time.perf_counter()
    with PrefixCache(model, cfg, model_id="bench-wear") as pc:
        for req in trace:
            pc.fetch(req.prompt)
            pc.store(req.stored, prefix_of(caches[req.seq], len(req.stored)))
        pc.flush()  # what the hot tier still holds dirty goes now (as at shutdown)
        st = pc.stats()
    ssd = st.get("ssd", {})
    return {
        "written": ssd.get("written_bytes", 0),
        "num_writes": ssd.get("num_writes", 0),
        "hit": st["cached_tokens"] / st["prompt_tokens"],
        "skipped": st["ssd_writes_skipped"],
        "deferred": st["ssd_writes_deferred"],
        "ssd_hits": st["ssd_block_hits"],
        "seconds": time.perf_counter() - began,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turns-per-visit", type=int, default=3, help="turns before a chat pauses")
    p.add_argument("--active", type=int, default=3, help="chat visits in flight at once")
    p.add_argument("--pause", type=int, default=6, help="chats started before a chat resumes")
    p.add_argument("--one-offs", type=int, default=160)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--hot-blocks", type=int, default=48, help="hot tier size in blocks")
    p.add_argument("--policy", choices=("write_back", "write_through"), default="write_back")
    p.add_argument("--budget-share", type=float, default=0.3, help="of admit 1's bytes, per day")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model = build_model("llama")
    trace, seqs = make_trace(args)
    caches = sequence_caches(model, seqs)
    block_bytes = 2 * sum(c.keys[..., :BLOCK, :].nbytes for c in caches[0])
    num_tokens = sum(len(r.prompt) for r in trace)
    print(
        f"trace: {len(trace)} requests ({args.conversations} chats x {args.turns} turns, "
        f"{args.one_offs} one-offs), {num_tokens} prompt tokens; block {BLOCK} tokens = "
        f"{block_bytes} B; hot {args.hot_blocks} blocks; {args.policy}"
    )
    base = CacheConfig(
        block_size=BLOCK,
        hot_max_bytes=args.hot_blocks * block_bytes,
        ssd_max_bytes=1 << 34,
        ssd_min_free_bytes=0,
        write_policy=args.policy,
        counters_save_seconds=0,
    )
    rows: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="bench-wear-") as tmp:

        def run(name: str, cfg: CacheConfig) -> dict:
            got = serve(model, trace, caches, cfg.replace(ssd_dir=f"{tmp}/{len(rows)}"))
            rows.append((name, got))
            print(_line(name, got, rows[1][1] if len(rows) > 2 else None))
            return got

        run("hot only", base.replace(hot_cache_only=True))
        ref = run("admit 1", base)
        run("admit 2", base.replace(ssd_admit_after=2))
        budget = int(ref["written"] * args.budget_share)
        for admit in (1, 2):
            cfg = base.replace(ssd_admit_after=admit, ssd_write_budget=budget)
            run(f"admit {admit} + budget", cfg)
    print(f"\nbudget: {budget / 2**20:.2f} MiB per day ({args.budget_share:g} of admit 1's bytes)")
    print(_table(rows, ref))


def _line(name: str, got: dict, ref: dict | None) -> str:
    vs = f" ({100 * (1 - got['written'] / ref['written']):.0f}% fewer)" if ref else ""
    return (
        f"{name:20s} ssd written {got['written'] / 2**20:7.2f} MiB{vs}, hit share "
        f"{100 * got['hit']:5.1f}%, ssd block hits {got['ssd_hits']}, skipped "
        f"{got['skipped']}, deferred {got['deferred']}, {got['seconds']:.1f}s"
    )


def _table(rows: list[tuple[str, dict]], ref: dict) -> str:
    out = [
        "| configuration | SSD bytes written | vs admit 1 | hit share | vs admit 1 "
        "| SSD block hits | writes skipped | deferred |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, got in rows:
        fewer = 100 * (1 - got["written"] / ref["written"])
        vs = {"hot only": "n/a", "admit 1": "reference"}.get(name, f"-{fewer:.0f}%")
        out.append(
            f"| {name} | {got['written'] / 2**20:.2f} MiB | {vs}"
            + f" | {100 * got['hit']:.1f}% | {100 * (got['hit'] - ref['hit']):+.1f} pts"
            f" | {got['ssd_hits']} | {got['skipped']} | {got['deferred']} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
