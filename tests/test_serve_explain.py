"""``prefixcache serve`` explains its misses: the ``X-Prefixcache-Explain`` header on every
completion and ``POST /v1/cache/explain``, on a real server subprocess whose tiny model's
chat template strips reasoning from earlier assistant turns (as reasoning models' do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from test_explain import agent_turns
from test_serve_e2e import TIMEOUT, _ours, running

from prefixcache.tiny.models import STRIP_THINKING_TEMPLATE, save_model

HEADER = "X-Prefixcache-Explain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    model = save_model(root / "llama", "llama", chat_template=STRIP_THINKING_TEMPLATE)
    with running(_ours(model, root / "ssd"), root / "serve.log") as srv:
        yield srv


def chat(srv, messages: list[dict], **extra: object) -> tuple[dict[str, str], dict]:
    """(the header's fields, the reply) of one greedy chat completion."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 4, **extra}
    reply = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    reply.raise_for_status()
    return fields(reply.headers[HEADER]), reply.json()


def fields(header: str) -> dict[str, str]:
    """``cached=96; at=100; why=diverged; rerendered`` as a dict (a flag maps to "")."""
    return dict((*part.split("=", 1), "")[:2] for part in header.split("; "))


def explain(srv, body: object) -> requests.Response:
    return requests.post(srv.url + "/v1/cache/explain", json=body, timeout=TIMEOUT)


def test_agent_loop_header_names_the_rerendered_turn_each_time(server):
    """10 tool-call turns: from the second on, each request leaves the stored sequence
    inside the previous assistant message, whose reasoning the template now strips."""
    rows = []
    for i, messages in enumerate(agent_turns(10)):
        got, reply = chat(server, messages)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append((i, got, cached))
    first = rows[0][1]
    assert first["why"] == "new" and first["cached"] == "0"
    for i, got, cached in rows[1:]:
        assert got["why"] == "diverged", (i, got)
        assert (got["message"], got["role"]) == (str(2 * i), "assistant"), (i, got)
        assert "rerendered" in got
        assert int(got["cached"]) == cached <= int(got["at"])


def test_a_chat_of_user_turns_is_not_named_rerendered(server):
    """Negative control on the same server and template: a chat that adds only user
    messages leaves the stored sequence in the new user message's role header (the
    stored one went on as the assistant's turn): diverged, but nothing re-rendered."""
    system = {"role": "system", "content": "Another team's system prompt, no tools. " * 4}
    users = [{"role": "user", "content": f"Question {i} about the timetable?"} for i in range(4)]
    for i in range(len(users)):
        got, _ = chat(server, [system, *users[: i + 1]])
        if i:
            assert got["why"] == "diverged" and "rerendered" not in got, (i, got)
            assert (got["message"], got["role"]) == (str(i + 1), "user"), (i, got)


def test_header_comes_with_a_streamed_reply_too(server):
    messages = agent_turns(1)[0]
    body = {"messages": messages, "max_tokens": 2, "stream": True, "temperature": 0}
    with requests.post(
        server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT, stream=True
    ) as reply:
        reply.raise_for_status()
        got = fields(reply.headers[HEADER])
        b"".join(reply.iter_content(None))
    assert got["why"] in ("ended", "diverged", "cached") and int(got["cached"]) > 0


def test_explain_endpoint_answers_the_record_and_generates_nothing(server):
    first, second = agent_turns(12)[-2:]
    chat(server, first)
    doc = explain(server, {"messages": second, "max_tokens": 4})
    assert doc.status_code == 200, doc.text
    got = doc.json()
    assert got["why"] == "diverged" and got["rerendered"] is True
    assert (got["message"], got["role"]) == (2 * 11, "assistant")
    assert (got["before_text"] + got["stored_text"]).endswith("<think>I should call the")
    assert "<think>" not in got["before_text"] + got["prompt_text"]
    assert explain(server, {"messages": second}).json() == got  # nothing stored meanwhile
    other = explain(server, {"messages": second, "cache_salt": "team-b"}).json()
    assert other["why"] == "other_namespace" and "team-b" in other["namespace"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": 5}, "cache_salt"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
        ([1, 2], "object"),
    ],
)
def test_explain_endpoint_refuses_a_malformed_body_naming_it(server, body, named):
    turn = agent_turns(2)[0]
    chat(server, turn)
    refused = explain(server, body)
    assert refused.status_code == 400
    message = refused.json()["error"]
    assert named in message and "\n" not in message
    usage = chat(server, turn)[1]["usage"]  # nothing stored was lost: all but one token
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_explain_endpoint_refuses_what_is_not_json(server):
    reply = requests.post(
        server.url + "/v1/cache/explain",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]


def test_serve_log_has_no_traceback(server):
    text = Path(server.log).read_text(errors="replace")
    assert "Traceback" not in text, text[text.find("Traceback") - 300 :][:3000]
