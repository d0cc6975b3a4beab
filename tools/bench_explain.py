"""What explaining a request costs, against the fetch it explains (in process, hot tier).

A tiny random-weight llama (hidden 64, 2 layers) and a PrefixCache holding a
chat's previous turn. Per request of ``--tokens`` tokens the next turn's prompt
diverges from the stored one; measured (median of ``--repeat`` runs, each its
own fresh fetch):

  fetch               ``pc.fetch``: lookup and restore (the reference)
  explain after fetch ``pc.explain`` right after it (serve's header: the fetch's
                      lookup reused)
  explain alone       ``pc.explain`` with no fetch before it (its own lookup)
  placed in messages  the divergence placed in ``--messages`` chat messages
                      (serve's header, on the HTTP thread: log2(messages) renders)

and the memory of the tiers' record of losses (tiers/losses.py) full, its keys
included (tracemalloc).

Timings are of a 2-core CPU shared with other work: compare the rows of one run.

    python tools/bench_explain.py [--tokens 2048] [--messages 21] [--repeat 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.messages import renderer
from prefixcache.tiers.losses import MAX_KEYS, Losses
from prefixcache.tiny.models import STRIP_THINKING_TEMPLATE, build_model, save_tokenizer


def chat(num_messages: int, words: int) -> list[dict]:
    """A system message, a user's, then tool-call turns with reasoning."""
    messages = [
        {"role": "system", "content": "You are a careful assistant with tools. " * words},
        {"role": "user", "content": "Find the weather in every capital."},
    ]
    i = 0
    while len(messages) < num_messages:
        think = f"<think>Step {i}: call the tool next.</think>"
        messages.append({"role": "assistant", "content": f"{think}<tool_call>{i}</tool_call>"})
        messages.append({"role": "tool", "content": f"result {i}: sunny"})
        i += 1
    return messages[:num_messages]


def losses_bytes() -> tuple[int, int]:
    """(entries, bytes) of a full record of losses, 16-byte keys included."""
    tracemalloc.start()
    losses = Losses()
    for _ in range(MAX_KEYS // 64):
        losses.lost("hot", [os.urandom(16) for _key in range(64)], "evicted")
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return len(losses), held


def median_ms(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (about)")
    parser.add_argument("--messages", type=int, default=21, help="chat messages")
    parser.add_argument("--repeat", type=int, default=30, help="runs per row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(Path(tmp), chat_template=STRIP_THINKING_TEMPLATE)
        tokenizer = load_tokenizer(Path(tmp))
    render = renderer(tokenizer)
    words = 1
    while len(render(chat(args.messages, words))) < args.tokens:
        words *= 2
    messages = chat(args.messages, words)
    tokens = list(render(messages))
    previous = list(render(messages[:-2]))  # the turn before: its last assistant kept whole
    model = build_model("llama")
    config = CacheConfig(block_size=16, hot_cache_only=True, hot_max_bytes=1 << 30)
    with PrefixCache(model, config, model_id="tiny") as pc:
        pc.prefill(previous)

        def fetch_then_explain() -> float:
            pc.fetch(tokens)
            start = time.perf_counter()
            pc.explain(tokens)
            return time.perf_counter() - start

        fetch = median_ms(lambda: pc.fetch(tokens), args.repeat)
        after = 1000 * statistics.median(fetch_then_explain() for _ in range(args.repeat))
        pc.match(previous)  # another prompt's lookup last: explain looks again
        alone = median_ms(lambda: (pc.match(previous), pc.explain(tokens)), args.repeat)
        alone -= median_ms(lambda: pc.match(previous), args.repeat)
        record = pc.explain(tokens)
        placed = median_ms(
            lambda: pc.explainer.placed(record, tokens, messages, tokenizer, None), args.repeat
        )
    got = pc.explainer.placed(record, tokens, messages, tokenizer, None)
    print(f"prompt {len(tokens)} tokens, {len(messages)} messages: {got.short()}")
    print(f"{'':22}{'ms':>9} {'x fetch':>8}")
    for name, ms in (
        ("fetch", fetch),
        ("explain after fetch", after),
        ("explain alone", alone),
        ("placed in messages", placed),
    ):
        print(f"{name:22}{ms:9.3f} {ms / fetch:8.3f}")
    entries, held = losses_bytes()
    each = held / entries
    print(f"record of losses: {entries} keys, {held / 2**20:.2f} MiB ({each:.0f} B a key)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
