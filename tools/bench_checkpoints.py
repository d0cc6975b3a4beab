"""The checkpoint protocol on an interleaved chat trace: reuse, exactness, cost, bytes.

For every cache layout (tiny random-weight models, offline), one interleaved
multi-turn chat trace (random tokens: ``--conversations`` over 3 shared system
prompts, ``--turns`` each; a reply's tokens are fed as decoding feeds them, all
but the last) is served twice, in one run:

- ``protocol``: the README's scheduler loop: ``fetch``, prefill to each of
  ``checkpoints`` and ``capture`` there, prefill the rest, ``store`` what the
  cache holds;
- ``plain``: ``fetch``, prefill the rest, ``store``.

Per layout: cached / reusable tokens (reusable: the longest prefix some earlier
stored sequence shares with the prompt, one token left), every restore checked
against a live run from scratch chunked as the restored state was computed
(bit-exact on the CPU; ``wrong`` counts mismatches), a negative control (another
system prompt's restored state continued alike must differ), the time spent in
``checkpoints`` + ``capture`` against the prefill time the extra reuse saves,
and stored bytes per token (state snapshots against the attention K/V under them).

    python tools/bench_checkpoints.py [--layouts qwen3_next lfm2 ...] [--conversations 24]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache
from prefixcache.hashing import common_tokens, token_bytes
from prefixcache.tiny.models import build_model

QUANT = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
LAYOUTS = {  # name: (arch, model overrides, kv quantization (bits, group, start))
    "kv": ("llama", {}, None),
    "quantized": ("llama", QUANT, (4, 32, 0)),
    "rotating": ("gemma3_text", {}, None),
    "chunked": ("llama4", {}, None),
    "qwen3_next": ("qwen3_next", {}, None),
    "lfm2": ("lfm2", {}, None),
    "mamba2": ("mamba2", {}, None),
    "falcon_h1": ("falcon_h1", {}, None),
}


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p


def random_tokens(rng: np.random.Generator, low: int, high: int) -> list[int]:
    return rng.integers(0, 512, int(rng.integers(low, high))).tolist()


def make_trace(args) -> list[tuple[int, list[int], list[int]]]:
    """(conversation, prompt, reply) in serving order: turns round-robin over the
    conversations, each prompt the conversation so far plus a new user message."""
    rng = np.random.default_rng(args.seed)
    systems = [random_tokens(rng, args.system_tokens, args.system_tokens + 1) for _ in range(3)]
    history = [list(systems[c % 3]) for c in range(args.conversations)]
    out = []
    for _ in range(args.turns):
        for c in rng.permutation(args.conversations).tolist():
            prompt = history[c] + random_tokens(rng, 20, 60)
            reply = random_tokens(rng, 8, 24)
            out.append((c, prompt, reply))
            history[c] = prompt + reply[:-1]  # what the cache holds after decoding
    return out


class Runner:
    """A model and its KV quantization schedule; counts the time spent prefilling."""

    def __init__(self, model, kv):
        self.model, self.kv = model, kv
        self.seconds = 0.0
        self.tokens = 0

    def run(self, tokens: list[int], cache: list) -> mx.array:
        began = time.perf_counter()
        logits = self.model(mx.array([tokens]), cache=cache)[:, -1, :]
        if self.kv is not None:
            maybe_quantize_kv_cache(cache, self.kv[2], self.kv[1], self.kv[0])
        mx.eval(logits, [c.state for c in cache])
        self.seconds += time.perf_counter() - began
        self.tokens += len(tokens)
        return logits

    def live(self, tokens: list[int], ends: list[int]) -> mx.array:
        cache, pos, logits = make_prompt_cache(self.model), 0, None
        for end in [*ends, len(tokens)]:
            if end > pos:
                logits = self.model(mx.array([tokens[pos:end]]), cache=cache)[:, -1, :]
                if self.kv is not None:
                    maybe_quantize_kv_cache(cache, self.kv[2], self.kv[1], self.kv[0])
                mx.eval(logits, [c.state for c in cache])
                pos = end
        return logits


def serve(pc, runner: Runner, prompt, reply, protocol: bool) -> dict:
    """One request through the scheduler loop; what it restored, its chunk ends, its logits."""
    cache, n = pc.fetch(prompt)
    restored, ends, overhead = n, [], 0.0
    if protocol:
        began = time.perf_counter()
        stops = pc.checkpoints(prompt, n)
        overhead += time.perf_counter() - began
        for stop in stops:
            runner.run(prompt[n:stop], cache)
            began = time.perf_counter()
            pc.capture(prompt[:stop], cache)
            overhead += time.perf_counter() - began
            ends.append(stop)
            n = stop
    logits = runner.run(prompt[n:], cache)
    if len(reply) > 1:
        runner.run(reply[:-1], cache)
    began = time.perf_counter()
    pc.store(prompt + reply[:-1], cache)
    overhead += time.perf_counter() - began
    return {"cached": restored, "ends": ends, "logits": logits, "overhead": overhead}


def producers(stored: list[tuple[bytes, list[int]]], data: bytes, n: int) -> list[list[int]]:
    """Chunk-end lists under which the restored state at ``n`` may have been computed:
    those of every stored sequence sharing ``n`` tokens with the prompt."""
    found = []
    for seq, bounds in stored:
        if common_tokens(seq, data) >= n:
            ends = sorted({*(b for b in bounds if b < n), n})
            if ends not in found:
                found.append(ends)
    return found or [[n]]


def run_trace(model, kv, trace, args, protocol: bool) -> dict:
    cfg = CacheConfig(block_size=args.block_size, hot_cache_only=True, hot_max_bytes=8 << 30)
    quant = {} if kv is None else dict(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
    cfg = cfg.replace(**quant)
    runner = Runner(model, kv)
    stored: list[tuple[bytes, list[int]]] = []
    cached = reusable = wrong = checked = 0
    overhead = 0.0
    last_logits: dict[int, tuple[list[int], int, mx.array]] = {}
    with PrefixCache(model, cfg, model_id="bench") as pc:
        for conv, prompt, reply in trace:
            data = token_bytes(prompt)
            reusable += min(
                len(prompt) - 1, max((common_tokens(s, data) for s, _ in stored), default=0)
            )
            out = serve(pc, runner, prompt, reply, protocol)
            n = out["cached"]
            cached += n
            overhead += out["overhead"]
            bounds: list[int] = []
            if n:  # exact against a live run chunked as the restored state was computed
                checked += 1
                candidates = producers(stored, data, n)
                ok = [c for c in candidates if _exact(runner, prompt, c + out["ends"], out)]
                wrong += not ok
                bounds = ok[0] if ok else candidates[0]
            full = prompt + reply[:-1]
            stored.append((token_bytes(full), sorted({*bounds, *out["ends"], len(prompt)})))
            last_logits[conv] = (prompt, n, out["logits"])
        sizes = _sizes(pc)
    return {
        "cached": cached,
        "reusable": reusable,
        "wrong": wrong,
        "checked": checked,
        "overhead": overhead,
        "prefill_s_token": runner.seconds / max(1, runner.tokens),
        "control": _negative_control(runner, last_logits),
        **sizes,
    }


def _exact(runner: Runner, prompt, ends, out) -> bool:
    live = runner.live(prompt, sorted(set(ends)))
    return mx.abs(live - out["logits"]).max().item() == 0.0


def _negative_control(runner: Runner, last) -> bool:
    """The exactness check rejects a state of another prefix: a conversation's restored
    and continued logits against another system prompt's first tokens continued alike."""
    (conv, (prompt, n, logits)), *others = sorted(last.items())
    other = next((p for c, (p, _, _) in others if c % 3 != conv % 3), None)
    if not n or other is None or len(other) < n:
        return False
    live = runner.live(other[:n] + prompt[n:], [n])
    return mx.abs(live - logits).max().item() > 0.0


def _sizes(pc) -> dict:
    """Bytes per token of the full blocks, and what restore points keep (recurrent
    state, window and chunk K/V) against the full-attention K/V (the
    ``snapshot_ratio`` budget; None without full-attention layers)."""
    layout = pc.layout
    kept = tuple(layout.state_prefixes) + tuple(layout.window_prefixes)
    points = kv = tokens = 0
    for block in pc.hot:
        for name, arr in block.arrays.items():
            if kept and name.startswith(kept):
                points += arr.nbytes
            else:
                kv += arr.nbytes
        if block.num_tokens == pc.config.block_size:
            tokens += block.num_tokens
    return {
        "b_token": (points + kv) / max(1, tokens),
        "points_ratio": points / kv if kv else None,
        "ratio": pc.config.snapshot_ratio,
    }


def main() -> None:
    args = setup_arg_parser().parse_args()
    trace = make_trace(args)
    tokens = sum(len(p) for _, p, _ in trace)
    print(f"trace: {len(trace)} requests, {tokens} prompt tokens, block {args.block_size}")
    rows = []
    for name in args.layouts:
        arch, overrides, kv = LAYOUTS[name]
        model = build_model(arch, **overrides)
        plain = run_trace(model, kv, trace, args, protocol=False)
        proto = run_trace(model, kv, trace, args, protocol=True)
        # what the protocol adds: checkpoints + captures + store, less plain's store
        extra = proto["overhead"] - plain["overhead"]
        saved = (proto["cached"] - plain["cached"]) * proto["prefill_s_token"]
        row = {
            "layout": name,
            "plain": plain["cached"] / max(1, plain["reusable"]),
            "protocol": proto["cached"] / max(1, proto["reusable"]),
            "cached": proto["cached"],
            "reusable": proto["reusable"],
            "wrong": proto["wrong"] + plain["wrong"],
            "checked": proto["checked"] + plain["checked"],
            "control": proto["control"],
            "cost": extra / saved if saved > 0 else float("nan"),
            "extra_ms": extra * 1e3,
            "b_plain": plain["b_token"],
            "b_proto": proto["b_token"],
            "points_ratio": proto["points_ratio"],
            "snapshot_ratio": proto["ratio"],
        }
        rows.append(row)
        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    print()
    heads = [
        ("layout", "layout"),
        ("plain", "plain fetch/store: cached / reusable"),
        ("protocol", "protocol: cached / reusable"),
        ("cached", "cached"),
        ("reusable", "reusable"),
        ("wrong", "wrong restores"),
        ("checked", "restores checked"),
        ("control", "negative control caught"),
        ("cost", "checkpoints + captures / prefill saved"),
        ("b_plain", "plain B/token"),
        ("b_proto", "protocol B/token"),
        ("points_ratio", "state + window K/V / full-attention K/V"),
        ("snapshot_ratio", "snapshot_ratio"),
    ]
    print("| " + " | ".join(h for _, h in heads) + " |")
    print("|" + "---|" * len(heads))
    for row in rows:
        print("| " + " | ".join(_fmt(row[k]) for k, _ in heads) + " |")


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    main()
