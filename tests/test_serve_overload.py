"""``prefixcache serve`` under a burst: requests queued together reuse a stored prefix.

mlx-lm's server admits every queued request at once (a fetch each) and after
each admission trims the prompt cache to its budget less the bytes of every
cache in its batch, queued ones included. A restore whose buffer had room for
the whole prompt made each queued request count as its whole prompt: a burst
emptied the hot tier, and the later requests of the burst missed the prefix
the earlier ones had just fetched. A request taken while the batch is busy now
gets a buffer of its cached tokens only (serve/prompt_cache.py).

The burst is made deterministic by a request served on mlx-lm's sequential
path (it sets ``seed``): it holds the generation thread while the burst's
requests queue up behind it.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer
from test_serve_e2e import running

from prefixcache.tiny.models import save_model
from prefixcache.traces.replay_http import word_tokens

BLOCK = 16
PREFIX = 64  # tokens every request of the burst shares (4 blocks)
REST = 600  # tokens of each request's own rest
BURST = 8
TIMEOUT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("model") / "llama", "llama")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as reply:
        return json.load(reply)


def _cached(url: str, text: str) -> int:
    body = {"prompt": text, "max_tokens": 1, "temperature": 0}
    return _post(url, body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _burst(model_dir: Path, tmp_path: Path, budget: int) -> list[int]:
    """Cached tokens of each request of a burst behind a sequential request, after
    one request stored the shared prefix."""
    tokenizer = load_tokenizer(model_dir)
    words = word_tokens(tokenizer)
    rng = random.Random(0)

    def text(n: int) -> str:
        return tokenizer.decode([rng.choice(words) for _ in range(n)])

    prefix = text(PREFIX)
    rests = [text(REST) for _ in range(BURST)]
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model_dir)]
    argv += ["--hot-cache-only", "--block-size", str(BLOCK), "--prompt-cache-bytes", str(budget)]
    with running(argv, tmp_path / f"serve-{budget}.log") as server:
        assert _cached(server.url, prefix + text(8)) == 0  # stores the prefix
        started = threading.Event()
        long = {"prompt": text(16), "max_tokens": 1000, "temperature": 0, "seed": 0}
        long |= {"stream": True, "logit_bias": {str(tokenizer.eos_token_id): -100}}

        lines: list[bytes] = []

        def sequential() -> None:
            req = urllib.request.Request(
                server.url + "/v1/completions",
                data=json.dumps(long).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT) as reply:
                    for line in reply:
                        lines.append(line)
                        started.set()
            finally:
                started.set()  # a failure shows below, not as a wait

        blocker = threading.Thread(target=sequential)
        blocker.start()
        assert started.wait(TIMEOUT) and lines, "the sequential request failed"
        with ThreadPoolExecutor(BURST) as pool:
            cached = list(pool.map(lambda r: _cached(server.url, prefix + r), rests))
        blocker.join(TIMEOUT)
    return cached


def test_a_burst_reuses_the_prefix_stored_before_it(model_dir, tmp_path):
    # 512 bytes a token: a restore with room for its prompt is 332 KiB, without 32 KiB
    cached = _burst(model_dir, tmp_path, 1536 << 10)
    assert all(n >= PREFIX for n in cached), cached


def test_a_burst_past_the_budget_loses_the_prefix(model_dir, tmp_path):
    # negative control: the burst queued together (its restores count at once)
    cached = _burst(model_dir, tmp_path, 400 << 10)
    assert any(n < PREFIX for n in cached), cached
