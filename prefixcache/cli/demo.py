"""``prefixcache demo``: multi-turn chats sharing a system prompt, with and without the cache.

Writes a small random-weight llama with a tokenizer trained on the shipped
corpus (``tiny.save_model``: no downloads) and loads it with ``mlx_lm.load``,
or loads ``--model PATH`` (a local mlx-lm model directory). It runs a few
interleaved chats through the model's chat template and prints per turn:
prompt tokens, tokens served from the cache, time-to-first-token cold (no
cache) and warm (PrefixCache), whether the first token is the same, and the
hot tier's bytes. Then it reopens the cache as a restarted process would and
serves an old conversation from the SSD tier.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache.prefix_cache import PrefixCache
from ..config import CacheConfig
from ..tiny.models import CORPUS_PATH, save_model

DEMO_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
STEP = 256  # prefill chunk, a multiple of the block size


def _prefill(model, tokens: list[int], cache: list[Any]) -> int:
    """Prefill ``tokens`` into ``cache`` in chunks; return the greedy next token."""
    logits = None
    for start in range(0, len(tokens), STEP):
        logits = model(mx.array([tokens[start : start + STEP]]), cache=cache)[:, -1, :]
        mx.eval(logits)
    return int(mx.argmax(logits, axis=-1).item())


def _generate(model, first: int, cache: list[Any], n: int) -> list[int]:
    out = [first]
    for _ in range(n - 1):
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1, :]
        out.append(int(mx.argmax(logits, axis=-1).item()))
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _load(model_path: str | None, workdir: str):
    from mlx_lm import load

    if model_path is None:
        model_path = str(save_model(f"{workdir}/model", "llama", seed=0, **DEMO_MODEL))
    model, tokenizer = load(model_path)
    return model, tokenizer, model_path


def _texts(num: int, words: int) -> list[str]:
    """``num`` passages of about ``words`` words from the shipped corpus."""
    corpus = CORPUS_PATH.read_text().split()
    return [" ".join(corpus[(i * words) % len(corpus) :][:words]) for i in range(num)]


def demo_turns(
    num_conversations: int, num_turns: int, system_words: int, turn_words: int
) -> tuple[str, list[tuple[int, str]]]:
    """The demo's chats: the system prompt they share, and the user turns in the
    order the demo sends them (turn by turn, the conversations interleaved), each
    ``(conversation, text)``."""
    system, *users = _texts(1 + num_conversations * num_turns, system_words)
    users = [" ".join(u.split()[:turn_words]) for u in users]
    return system, [
        (conv, users.pop()) for _ in range(num_turns) for conv in range(num_conversations)
    ]


def run_demo(
    *,
    model_path: str | None = None,
    ssd_dir: str | None = None,
    num_conversations: int = 3,
    num_turns: int = 3,
    system_words: int = 500,
    turn_words: int = 60,
    reply_tokens: int = 16,
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    """Run the demo; returns one row per turn (also printed)."""
    with tempfile.TemporaryDirectory(prefix="prefixcache-demo-") as tmp:
        model, tokenizer, model_path = _load(model_path, tmp)
        ssd_dir = ssd_dir or f"{tmp}/ssd"
        config = CacheConfig(block_size=64, ssd_dir=ssd_dir, hot_max_bytes=256 << 20)
        system, turns = demo_turns(num_conversations, num_turns, system_words, turn_words)
        chats = [[{"role": "system", "content": system}] for _ in range(num_conversations)]
        print_fn(f"model: {model_path}")
        print_fn(f"cache: block_size={config.block_size} ssd_dir={ssd_dir}")
        print_fn(_HEADER)
        rows = []
        with PrefixCache(model, config, model_id=f"demo:{model_path}") as pc:
            for i, (conv, text) in enumerate(turns):
                chat = chats[conv]
                chat.append({"role": "user", "content": text})
                prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
                row = _turn(model, pc, prompt, reply_tokens)
                reply = tokenizer.decode(row.pop("reply"))
                chat.append({"role": "assistant", "content": reply})
                rows.append(row | {"conv": conv, "turn": i // num_conversations})
                print_fn(_format(rows[-1]))
        print_fn("after a restart (a new PrefixCache on the same ssd_dir):")
        with PrefixCache(model, config, model_id=f"demo:{model_path}") as pc:
            chats[0].append({"role": "user", "content": "And one more question."})
            prompt = tokenizer.apply_chat_template(chats[0], add_generation_prompt=True)
            row = _turn(model, pc, prompt, reply_tokens)
            row.pop("reply")
            rows.append(row | {"conv": 0, "turn": num_turns})
            print_fn(_format(rows[-1]))
            ssd = pc.stats().get("ssd", {})
            print_fn(
                f"ssd tier: {ssd.get('num_blocks', 0)} blocks, "
                f"{ssd.get('nbytes', 0) / 2**20:.1f} MiB; served from it: "
                f"{pc.stats()['ssd_block_hits']} blocks"
            )
    return rows


_HEADER = (
    f"{'conv':>4} {'turn':>4} {'prompt':>6} {'cached':>6} {'cold ms':>8} {'warm ms':>8} "
    f"{'speedup':>7} {'same':>5} {'hot MiB':>8}"
)


def _turn(model, pc: PrefixCache, prompt: list[int], reply_tokens: int) -> dict[str, Any]:
    cold_cache = make_prompt_cache(model)
    cold_first, cold_s = _timed(lambda: _prefill(model, prompt, cold_cache))

    def warm() -> tuple[list[Any], int, int]:
        cache, num_cached = pc.fetch(prompt)
        return cache, num_cached, _prefill(model, prompt[num_cached:], cache)

    (cache, num_cached, first), warm_s = _timed(warm)
    reply = _generate(model, first, cache, reply_tokens)
    # The cache now holds prompt + reply[:-1]: store exactly those tokens.
    pc.store(prompt + reply[:-1], cache)
    return {
        "prompt": len(prompt),
        "cached": num_cached,
        "cold_ms": cold_s * 1e3,
        "warm_ms": warm_s * 1e3,
        "same": float(first == cold_first),
        "hot_mib": pc.stats()["hot"]["nbytes"] / 2**20,
        "reply": reply,
    }


def _format(row: dict[str, float]) -> str:
    speedup = row["cold_ms"] / max(row["warm_ms"], 1e-9)
    return (
        f"{row['conv']:>4} {row['turn']:>4} {row['prompt']:>6} {row['cached']:>6} "
        f"{row['cold_ms']:>8.0f} {row['warm_ms']:>8.0f} {speedup:>6.1f}x "
        f"{'yes' if row['same'] else 'NO':>5} {row['hot_mib']:>8.2f}"
    )
