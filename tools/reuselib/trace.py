"""The multi-turn chat trace every server is driven with, and its records.

Deterministic text (corpus words drawn from a seeded generator; each message's
words depend only on the seed, the conversation and the turn), replies
appended to the history as the server gave them:

  seq    ``conversations`` conversations over ``num_systems`` shared system
         prompts, interleaved turn by turn, one request at a time
  conc   ``clients`` threads, each a new conversation on system ``k % num_systems``;
         a barrier before each turn sends the requests together, so mlx-lm's
         BatchGenerator prefills and decodes them in one batch
  probe  on a system prompt the trace never used: a 2-turn chat and its next
         turn, a new conversation on the same system prompt, and an exact
         repeat of the next turn's request
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.tiny.models import CORPUS_PATH

from .servers import Reply

Messages = list[dict[str, str]]
Chat = Callable[[Messages], Reply]
PHASES = ("seq", "conc", "probe")
PROBES = ("turn1", "turn2", "next_turn", "new_conv", "repeat")
BARRIER_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class TraceConfig:
    conversations: int = 6
    turns: int = 3
    clients: int = 3
    num_systems: int = 3
    system_words: int = 260  # about 600 tokens with the tiny models' tokenizer
    user_words: int = 12
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Record:
    """One request and the server's answer. ``key`` is the request's messages as JSON."""

    phase: str  # seq, conc or probe
    probe: str  # a name of PROBES in the probe phase, else ""
    conv: int
    turn: int
    key: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    started: float  # perf_counter() when sent
    seconds: float
    error: str

    def overlaps(self, other: Record) -> bool:
        """Whether the two requests were in flight at the same time."""
        ends, other_ends = self.started + self.seconds, other.started + other.seconds
        return self.started < other_ends and other.started < ends


def request_key(messages: Messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


class Text:
    """Seeded word salad from the tiny tokenizer's corpus (so it tokenizes densely)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.words = CORPUS_PATH.read_text(encoding="utf-8").split()

    def words_for(self, *where: object, n: int) -> str:
        rng = random.Random(repr((self.seed, *where)))
        return " ".join(rng.choice(self.words) for _ in range(n))

    def system(self, index: int, n: int) -> str:
        return f"You are assistant {index}. " + self.words_for("system", index, n=n)

    def user(self, conv: int, turn: int, n: int) -> str:
        return self.words_for("user", conv, turn, n=n) + "?"


class Conversation:
    """A growing message history; ``step`` asks the next question and keeps the reply."""

    def __init__(self, text: Text, cfg: TraceConfig, conv: int, system: int, phase: str):
        self.text, self.cfg, self.conv, self.phase = text, cfg, conv, phase
        self.messages: Messages = [
            {"role": "system", "content": text.system(system, cfg.system_words)}
        ]
        self.turn = 0

    def step(self, chat: Chat, probe: str = "") -> Record:
        question = self.text.user(self.conv, self.turn, self.cfg.user_words)
        self.messages.append({"role": "user", "content": question})
        record = ask(chat, self.messages, self.phase, probe, self.conv, self.turn)
        self.messages.append({"role": "assistant", "content": record.reply})
        self.turn += 1
        return record


def ask(chat: Chat, messages: Messages, phase: str, probe: str, conv: int, turn: int) -> Record:
    started = time.perf_counter()
    reply = chat([dict(m) for m in messages])
    return Record(
        phase=phase,
        probe=probe,
        conv=conv,
        turn=turn,
        key=request_key(messages),
        reply=reply.text,
        prompt_tokens=reply.prompt_tokens,
        cached_tokens=reply.cached_tokens,
        started=started,
        seconds=reply.seconds,
        error=reply.error,
    )


def run_sequential(chat: Chat, cfg: TraceConfig, text: Text) -> list[Record]:
    convs = [
        Conversation(text, cfg, c, c % cfg.num_systems, "seq") for c in range(cfg.conversations)
    ]
    return [conv.step(chat) for _ in range(cfg.turns) for conv in convs]


def run_concurrent(chat: Chat, cfg: TraceConfig, text: Text) -> list[Record]:
    """``clients`` threads, one new conversation each, turns sent together."""
    barrier = threading.Barrier(cfg.clients, timeout=BARRIER_TIMEOUT)
    out: list[list[Record]] = [[] for _ in range(cfg.clients)]

    def client(k: int) -> None:
        conv = Conversation(text, cfg, cfg.conversations + k, k % cfg.num_systems, "conc")
        for _ in range(cfg.turns):
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()  # broken: another client is stuck, go on alone
            out[k].append(conv.step(chat))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(cfg.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for records in out for r in records]


def run_probes(chat: Chat, cfg: TraceConfig, text: Text) -> list[Record]:
    """A 2-turn chat, its next turn, a new conversation on its system prompt, a repeat."""
    first = cfg.conversations + cfg.clients
    chat_a = Conversation(text, cfg, first, cfg.num_systems, "probe")
    records = [chat_a.step(chat, probe) for probe in PROBES[:3]]
    chat_b = Conversation(text, cfg, first + 1, cfg.num_systems, "probe")
    records.append(chat_b.step(chat, "new_conv"))
    again = json.loads(records[2].key)
    records.append(ask(chat, again, "probe", "repeat", first, 2))
    return records


def run_trace(chat: Chat, cfg: TraceConfig) -> list[Record]:
    """Every phase in order against one server's ``chat``."""
    text = Text(cfg.seed)
    return [
        *run_sequential(chat, cfg, text),
        *run_concurrent(chat, cfg, text),
        *run_probes(chat, cfg, text),
    ]
