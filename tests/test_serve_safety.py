"""No request stops ``prefixcache serve``: real servers (subprocesses) over HTTP.

Every bad request of ``tools/badlib.BAD`` gets the 4xx chosen for it, and the
server still answers and generates after each, writing nothing outside its SSD
directory. A request made to raise inside mlx-lm's generation loop (a hook
``serve_child.py`` installs) gets a 500 naming the cause, the other request in
flight ends rather than hangs, the loop starts again at once (counted), and the
tiers keep every block: a cached conversation replies the same from the same
cached tokens. The control: plain ``mlx_lm.server`` with the same hook stays
down.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import requests
from test_serve_e2e import SYSTEM, TIMEOUT, _free_port, _ours, model_dir, running  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from badlib import BAD, health, send
from serve_child import RAISE
from test_cli import cli

EOS_IDS = (0, 1, 2)  # the tiny tokenizer's special tokens (prefixcache.tiny.models)
LONG = {  # a request that never ends by itself
    "max_tokens": 100_000,
    "logit_bias": {str(eos): -100 for eos in EOS_IDS},
    "messages": [{"role": "user", "content": "Tell me everything."}],
}
CHILD = str(Path(__file__).with_name("serve_child.py"))
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First train?"}]


def chat(server, messages=QUESTION, **extra) -> requests.Response:
    body = {"messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)


def answer(server) -> tuple[str, int]:
    reply = chat(server)
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    return doc["choices"][0]["message"]["content"], doc["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def test_bad_requests_get_4xx_and_leave_the_server_working(model_dir, tmp_path):  # noqa: F811
    ssd = tmp_path / "ssd"
    metrics = _free_port()
    argv = [*_ours(model_dir, ssd), "--metrics-port", str(metrics)]
    with running(argv, tmp_path / "serve.log") as server:
        for bad in BAD:
            status, text = send(server.url, bad)
            assert status == str(bad.expect), (bad.name, status, text)
            if bad.expect >= 400 and bad.expect != 431 and bad.path != "/v1/nothing":
                assert text.startswith('{"error": '), (bad.name, text)
            assert health(server.url) == "200", (bad.name, server.text()[-2000:])
        reply = chat(server)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        refused = sum(400 <= bad.expect < 500 and bad.expect != 431 for bad in BAD)
        assert _metric(metrics, "prefixcache_refused_requests_total") == refused
        assert _metric(metrics, "prefixcache_generation_restarts_total") == 0
        assert server.stop() == 0
    outside = {p.name for p in tmp_path.iterdir()} - {"ssd", "serve.log"}
    assert not outside, outside  # path-like session ids stayed names
    assert cli("verify", "--ssd-dir", str(ssd), "--json")["ok"]


def _stream_until_done(server, out: dict) -> None:
    """A long streamed request; ``out``: 'started' once its first chunk came, then its
    lines and when it ended."""
    body = {"messages": QUESTION, "stream": True, "temperature": 0, **LONG}
    with requests.post(
        server.url + "/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT
    ) as reply:
        out["status"] = reply.status_code
        if reply.status_code != 200:
            out["started"].set()  # it will not: the test says why
        for line in reply.iter_lines():
            if line.startswith(b"data: {"):
                out.setdefault("lines", []).append(line)
                out["started"].set()
    out["ended"] = time.monotonic()


def _metric(metrics_port: int, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT).text
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert lines, (name, text)
    return float(lines[0].split()[1])


def test_a_generation_loop_that_raises_is_restarted_and_nothing_is_lost(model_dir, tmp_path):  # noqa: F811
    metrics = _free_port()
    argv = [sys.executable, CHILD, "ours", *_ours(model_dir, tmp_path / "ssd")[4:]]
    argv += ["--metrics-port", str(metrics)]
    with running(argv, tmp_path / "serve.log") as server:
        first, _ = answer(server)
        reply, cached = answer(server)
        assert reply == first and cached > 0
        hot = _metric(metrics, "prefixcache_hot_blocks")
        out: dict = {"started": threading.Event()}
        streaming = threading.Thread(target=_stream_until_done, args=(server, out))
        streaming.start()
        assert out["started"].wait(TIMEOUT), "the long request never started"
        assert out["status"] == 200, out
        fetches = _metric(metrics, "prefixcache_fetches_total")
        whole: list = []  # a long request answered whole, in flight too
        waiting = threading.Thread(target=lambda: whole.append(chat(server, **LONG)))
        waiting.start()
        while _metric(metrics, "prefixcache_fetches_total") == fetches:  # until it is taken
            assert waiting.is_alive(), whole[0].text
            time.sleep(0.01)

        killed = chat(server, stop=[RAISE])
        failed_at = time.monotonic()
        assert killed.status_code == 500, killed.text
        assert "raised on purpose in the generation loop" in killed.json()["error"]
        streaming.join(TIMEOUT)
        assert not streaming.is_alive(), "the request in flight hung"
        assert b'"error"' in out["lines"][-1], out["lines"][-1]  # it ended with an error event
        waiting.join(TIMEOUT)
        assert not waiting.is_alive(), "the request in flight hung"
        assert whole[0].status_code == 500 and "raised on purpose" in whole[0].json()["error"]

        while health(server.url) != "200":
            assert time.monotonic() - failed_at < 1.0, "not answering a second after"
            time.sleep(0.01)
        doc = requests.get(server.url + "/health", timeout=TIMEOUT).json()
        assert doc == {"status": "ok", "generation_restarts": 1}
        assert _metric(metrics, "prefixcache_generation_restarts_total") == 1
        assert answer(server) == (first, cached)  # the tiers kept every block
        assert _metric(metrics, "prefixcache_hot_blocks") >= hot
        assert _metric(metrics, "prefixcache_storage_errors_total") == 0
        assert server.stop() == 0
    assert "generation thread failed (RuntimeError: raised on purpose" in server.text()


def test_control_plain_mlx_lm_with_the_same_hook_stays_down(model_dir, tmp_path):  # noqa: F811
    argv = [sys.executable, CHILD, "plain", "--model", str(model_dir)]
    with running(argv, tmp_path / "plain.log") as server:
        assert chat(server).status_code == 200
        killed = chat(server, stop=[RAISE])
        assert killed.status_code == 404  # mlx-lm's answer to any failure
        assert health(server.url) == "503"
        assert chat(server).status_code == 404  # "generation thread died", for good
