"""``prefixcache serve`` with per-request cache fields, as a real subprocess over HTTP:
two tenants with different ``cache_salt`` never share a block; a bad field is a 400
naming it; serve's operator flags reach the cache."""

from __future__ import annotations

import contextlib
import sys
import time

import requests
from test_serve_e2e import MAX_TOKENS, SYSTEM, TIMEOUT, _ours, model_dir, running  # noqa: F401

QUESTION = "When does the first train leave the valley?"


def chat(server, salt: str | None = None, **extra) -> tuple[int, int]:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        **({"cache_salt": salt} if salt is not None else {}),
        **extra,
    }
    reply = requests.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    if not reply.ok:
        return reply.status_code, 0
    return 200, reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_tenants_with_different_salts_share_nothing(model_dir, tmp_path):  # noqa: F811
    argv = [*_ours(model_dir, tmp_path / "ssd"), "--ssd-admit-after", "1"]
    with running(argv, tmp_path / "serve.log") as server:
        assert chat(server, "tenant-a") == (200, 0)
        status, cached = chat(server, "tenant-a")  # same salt: cached
        assert status == 200 and cached > 0
        assert chat(server, "tenant-b") == (200, 0)  # other salt, same prompt: nothing
        status, cached_b = chat(server, "tenant-b")
        assert status == 200 and cached_b == cached  # its own blocks now
        assert chat(server) == (200, 0)  # no salt: a namespace of its own too
        status, _ = chat(server, 123)
        assert status == 400
        reply = requests.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "cache": {"persist": "no"}},
            timeout=TIMEOUT,
        )
        assert reply.status_code == 400 and "cache.persist" in reply.json()["error"]
        assert "'no'" in reply.json()["error"]
        assert chat(server, "tenant-a")[1] == cached  # nothing stored was lost


def ask(server, question: str, headers: dict | None = None, **extra) -> int:
    """Cached tokens of one chat request (system prompt SYSTEM) that must succeed."""
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        **extra,
    }
    url = server.url + "/v1/chat/completions"
    reply = requests.post(url, json=body, headers=headers or {}, timeout=TIMEOUT)
    assert reply.ok, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_sessions_persistence_and_pinned_system_prompts_through_serve(model_dir, tmp_path):  # noqa: F811
    from test_cli import cli

    ssd = tmp_path / "ssd"
    argv = [*_ours(model_dir, ssd), "--pin-system-prompts"]
    end = "/v1/sessions/"
    with running(argv, tmp_path / "serve.log") as server:
        assert ask(server, "Alice asks.", session_id="alice") == 0
        system = ask(server, "Bob asks.", headers={"X-Session-Id": "bob"})
        assert system > 0  # the system prompt, shared
        assert ask(server, "Alice asks.", session_id="alice") > system  # her own blocks too
        assert ask(server, "Carol asks.", cache={"persist": False}) == system
        reply = requests.delete(server.url + end + "alice", timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.json()["num_blocks"] > 0
        reply = requests.delete(server.url + end + "alice", timeout=TIMEOUT)
        assert reply.status_code == 404 and "unknown session 'alice'" in reply.json()["error"]
        assert requests.delete(server.url + end, timeout=TIMEOUT).status_code == 400
        assert ask(server, "Alice asks.") == system  # gone from every tier
        assert ask(server, "Bob asks.") > system  # the control: bob's session kept his
        assert ask(server, "Carol asks.", cache={"persist": False}) > system  # hot only
    with running(argv, tmp_path / "serve2.log") as server:  # restarted: what reached SSD
        assert ask(server, "Carol asks.") == system  # persist=False: never written
        assert ask(server, "Bob asks.") > system
    pinned = cli("ls", "--pinned", "--ssd-dir", str(ssd), "--json")["rows"]
    assert max(r["prefix_tokens"] for r in pinned) == system  # its system prompt, no more
    assert len(pinned) == -(-system // 16) and all(r["pinned_until"] is None for r in pinned)


def test_tenant_header_and_floors_reach_the_cache_and_its_metrics(model_dir, tmp_path):  # noqa: F811
    from test_serve_e2e import _free_port

    port = _free_port()
    argv = [
        *_ours(model_dir, tmp_path / "ssd"),
        "--hot-cache-only",
        "--hot-tenant-floors",
        "bob=64K",
        "--tenant-header",
        "X-Tenant",
        "--metrics-port",
        str(port),
    ]
    with running(argv, tmp_path / "serve.log") as server:
        assert ask(server, "Bob asks.", headers={"X-Tenant": "bob"}) == 0
        assert ask(server, "Bob asks again.", headers={"X-Tenant": "bob"}) > 0
        url = server.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}
        reply = requests.post(url, json=body, headers={"X-Tenant": "x" * 300}, timeout=TIMEOUT)
        assert reply.status_code == 400 and "X-Tenant" in reply.json()["error"]
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).text
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    assert int(series['prefixcache_tenant_blocks{tenant="bob",tier="hot"}']) > 0
    assert int(series['prefixcache_tenant_floor_bytes{tenant="bob",tier="hot"}']) == 64 << 10
    assert int(series['prefixcache_tenant_stored_total{tenant="bob",tier="hot"}']) > 0
    assert not any('tenant=""' in name for name in series)  # every store named bob


def test_models_listing_without_a_hugging_face_cache(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """``GET /v1/models`` where no Hugging Face cache directory exists: the served
    model, status 200 (mlx-lm's own handler raises there: its traceback is the
    control, read from plain ``mlx_lm.server``'s log)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    with running(_ours(model_dir, tmp_path / "ssd"), tmp_path / "serve.log") as server:
        reply = requests.get(server.url + "/v1/models", timeout=TIMEOUT)
        assert reply.status_code == 200, server.text()
        ids = [m["id"] for m in reply.json()["data"]]
        assert ids == [str(model_dir.resolve())]
        assert "Traceback" not in server.text()
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    with running(plain, tmp_path / "plain.log") as server:
        with contextlib.suppress(requests.ConnectionError):  # it may close after its 200
            requests.get(server.url + "/v1/models", timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT  # its handler thread logs the traceback
        while "CacheNotFound" not in server.text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "CacheNotFound" in server.text()
