"""``prefixcache explain`` as a real console script: a tiny model directory whose chat
template strips reasoning from earlier assistant turns, an SSD tier ``prefixcache pin``
filled with an agent's first turn, and the next turn explained from its chat JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer
from test_cli import cli
from test_explain import agent_turns

from prefixcache.tiny.models import STRIP_THINKING_TEMPLATE, save_model

BLOCK = 16


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model dir, SSD dir, the second turn's chat JSON), the first turn stored."""
    root = tmp_path_factory.mktemp("explain_cli")
    model = save_model(root / "llama", "llama", chat_template=STRIP_THINKING_TEMPLATE)
    first, second = agent_turns(2)
    text = load_tokenizer(model).apply_chat_template(
        first, add_generation_prompt=True, tokenize=False
    )
    (root / "first.txt").write_text(text)
    (root / "second.json").write_text(json.dumps({"messages": second}))
    ssd = root / "ssd"
    base = ["--model", str(model), "--ssd-dir", str(ssd), "--block-size", str(BLOCK)]
    cli("pin", *base, str(root / "first.txt"))
    return model, ssd, root / "second.json"


def explain(model: Path, ssd: Path, *args: str, code: int = 0) -> dict | str:
    base = ["--model", str(model), "--ssd-dir", str(ssd), "--block-size", str(BLOCK)]
    return cli("explain", *base, *args, code=code)


def test_the_next_turn_is_named_rerendered(stored):
    model, ssd, second = stored
    doc = explain(model, ssd, str(second), "--json")
    assert doc["why"] == "diverged" and doc["rerendered"] is True
    assert (doc["message"], doc["role"]) == (2, "assistant")
    assert (doc["before_text"] + doc["stored_text"]).endswith("<think>I should call the")
    assert doc["model"].startswith(str(model)) and doc["num_cached"] == doc["divergence"]
    text = explain(model, ssd, str(second))
    assert "in message 2 (assistant): an earlier turn the chat template renders" in text


def test_another_salt_and_plain_text(stored, tmp_path):
    model, ssd, second = stored
    salted = explain(model, ssd, str(second), "--salt", "team-b", "--json")
    assert salted["why"] == "other_namespace" and "team-b" in salted["namespace"]
    plain = explain(model, ssd, "--text", "Nothing like it was stored.", "--json")
    assert plain["why"] == "new" and plain["message"] is None  # not a chat: no message


def test_a_json_prompt_without_messages_is_one_line(stored, tmp_path):
    model, ssd, _ = stored
    (tmp_path / "bad.json").write_text('{"messages": []}')
    out = explain(model, ssd, str(tmp_path / "bad.json"), code=2)
    assert "'messages'" in out and len(out.strip().splitlines()) == 1
