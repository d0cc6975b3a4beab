"""``prefixcache serve --shared-prefix``: concurrent requests on one prefix hold it once.

In process, requests go through TieredPromptCache and one BatchGenerator as
mlx-lm's server batch path runs them; end to end, concurrent HTTP requests go to
a real ``prefixcache serve --shared-prefix`` and their replies are compared with
plain ``mlx_lm.server``'s.
"""

from __future__ import annotations

import sys
import threading

import pytest
import requests
from conftest import prefill, prompt, tiny_model
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from test_serve_e2e import BLOCK_SIZE, SYSTEM, _free_port, running
from test_server import HOT, KEY, NoCache

from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.shared import SharedBatchKVCache, SharedKVCache
from prefixcache.tiny.models import save_model

MAX_TOKENS = 6


def serve_together(cache, model, prompts) -> tuple[list[list[int]], list[int], list]:
    """Requests inserted into one BatchGenerator as the server batches concurrent ones:
    (tokens per request, cached tokens per request, the batch caches seen)."""
    gen = BatchGenerator(model)
    uids, cached, seen = [], [], []
    try:
        for tokens in prompts:
            restored, rest = cache.fetch_nearest_cache(KEY, tokens)
            cached.append(len(tokens) - len(rest))
            uids += gen.insert_segments(
                segments=[[rest]],
                max_tokens=[MAX_TOKENS],
                caches=[restored],
                all_tokens=[tokens[: cached[-1]]],
            )
        out = {u: [] for u in uids}
        for _ in range(4 * MAX_TOKENS + 8):
            _, responses = gen.next()
            seen += [
                c for c in gen._generation_batch.prompt_cache if isinstance(c, SharedBatchKVCache)
            ]
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    cache.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
            if all(len(v) == MAX_TOKENS for v in out.values()):
                return [out[u] for u in uids], cached, seen
    finally:
        gen.close()
    raise AssertionError("generation did not finish")


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_concurrent_requests_share_the_prefix_and_match_cold(arch):
    model = tiny_model(arch)
    system = prompt(1, 4 * 16)
    first = [system + prompt(10 + i, 5 + 4 * i) for i in range(3)]
    cold = serve_together(NoCache(), model, first)[0]
    with TieredPromptCache(lambda key: model, HOT, shared=True) as tiered:
        # the server inserts the system segment's cache at its end, as here
        system_cache = make_prompt_cache(model)
        prefill(model, system, system_cache)
        tiered.insert_cache(KEY, system, system_cache, cache_type="system")
        got, cached, seen = serve_together(tiered, model, first)
        stats = tiered.stats()["shared"]
    assert got == cold
    assert all(n >= len(system) for n in cached)
    # one prefix for the three requests, batched against it
    assert (stats["num_loads"], stats["num_reuses"]) == (1, 2)
    assert seen and all(len({id(row[0]) for row in b.rows}) == 1 for b in seen if len(b.rows) == 3)
    assert all(b.num_attends > 0 for b in seen)


def test_a_miss_gets_shared_types_so_the_batch_merges():
    model = tiny_model("llama")
    with TieredPromptCache(lambda key: model, HOT, shared=True) as tiered:
        restored, rest = tiered.fetch_nearest_cache(KEY, prompt(3, 20))
        assert len(rest) == 20 and all(isinstance(c, SharedKVCache) for c in restored)
        assert all(c.prefix is None for c in restored)
    with TieredPromptCache(lambda key: model, HOT) as plain:  # today's path: None on a miss
        assert plain.fetch_nearest_cache(KEY, prompt(3, 20))[0] is None


QUESTIONS = ("When does the first train leave?", "Is there a bus?", "Can I bring a bike?")
LONG = 48  # tokens per reply: the requests overlap while they decode


def _chat(server, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"messages": messages, "temperature": 0, "max_tokens": LONG}
    reply = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"] or ""


def _chat_all(server) -> list[str]:
    """The questions sent at once (threads), each after the shared system prompt."""
    replies = [""] * len(QUESTIONS)
    start = threading.Barrier(len(QUESTIONS))

    def ask(i: int) -> None:
        start.wait()
        replies[i] = _chat(server, QUESTIONS[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def _metrics(port: int) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        name: float(value)
        for name, value in (line.split() for line in text.splitlines() if line[:1] != "#")
    }


def test_serve_shared_prefix_end_to_end(tmp_path):
    model = save_model(tmp_path / "llama", "llama")
    port = _free_port()
    ours = [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--model",
        str(model),
        "--hot-cache-only",
        "--block-size",
        str(BLOCK_SIZE),
        "--shared-prefix",
        "--metrics-port",
        str(port),
    ]
    with running(ours, tmp_path / "ours.log") as server:
        _chat(server, "Hi")  # stores the system prompt
        got = _chat_all(server)
        metrics = _metrics(port)
        assert server.stop() == 0
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    with running(plain, tmp_path / "plain.log") as server:
        want = _chat_all(server)
    assert got == want
    assert metrics["prefixcache_shared_fetches"] == 1 + len(QUESTIONS)
    assert metrics["prefixcache_shared_fallbacks"] == 0
    # the concurrent requests found the first one's prefix live and shared it
    assert metrics["prefixcache_shared_reuses"] >= 1, metrics
