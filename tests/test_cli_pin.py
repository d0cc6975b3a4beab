"""``prefixcache pin`` / ``unpin`` / ``ls --pinned`` / ``stats`` (bytes written today, the
write budget left) as real console scripts, against a tiny model directory and an SSD
tier a real PrefixCache (or a real ``prefixcache serve``) opens afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import prompt
from test_cli import BASE, cli
from test_serve_e2e import SYSTEM, running

from prefixcache import CacheConfig, PrefixCache
from prefixcache.tiny.models import save_model

BLOCK = 16
TEXT = (
    "You answer questions about the valley railway. The first train leaves at seven, "
    "the last one at half past six; bicycles ride in the luggage van and dogs ride free. "
) * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("pin") / "llama", "llama")


def pin(model: Path, ssd: Path, *args: str, code: int = 0) -> dict | str:
    base = ["--model", str(model), "--ssd-dir", str(ssd), "--block-size", str(BLOCK)]
    return cli("pin", *base, *args, code=code)


def as_served(model: Path, config: CacheConfig) -> PrefixCache:
    """A PrefixCache on the directory under the model id ``prefixcache serve --model``
    gives this directory (mlx-lm's model key is the path as given)."""
    from mlx_lm import load

    from prefixcache.serve.fit import model_id_of

    loaded = load(str(model))
    return PrefixCache(loaded[0], config, model_id=model_id_of((str(model), None, None), loaded[0]))


def tokens_of(model: Path, text: str) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    return list(load_tokenizer(model).encode(text))


def test_a_pinned_prompt_outlives_10x_the_caps_of_other_traffic_and_a_restart(model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    doc = pin(model_dir, ssd, "--text", TEXT, "--json")
    tokens = tokens_of(model_dir, TEXT)
    assert doc["num_tokens"] == len(tokens) == doc["num_pinned_tokens"] > 3 * BLOCK
    assert doc["num_computed_tokens"] == len(tokens) and doc["until"] is None
    (tmp_path / "other.txt").write_text(TEXT.upper())  # the control: pinned, then unpinned
    other = pin(model_dir, ssd, str(tmp_path / "other.txt"), "--json")
    base = ["--model", str(model_dir), "--ssd-dir", str(ssd), "--block-size", str(BLOCK)]
    unpinned = cli("unpin", str(tmp_path / "other.txt"), *base, "--json")
    assert unpinned["num_unpinned_blocks"] == len(other["keys"])
    listed = cli("ls", "--pinned", "--ssd-dir", str(ssd), "--json")
    assert {r["key"] for r in listed["rows"]} == set(doc["keys"])  # the tail's key too
    assert all(r["pinned"] and r["pinned_until"] is None for r in listed["rows"])
    again = pin(model_dir, ssd, "--text", TEXT, "--json")  # pinned again: nothing computed
    assert again["num_computed_tokens"] == 1 and again["keys"] == doc["keys"]
    cap = 12 * 8192  # a dozen blocks of this model on SSD, half that in hot
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(ssd),
        ssd_min_free_bytes=0,
        hot_max_bytes=cap // 2,
        ssd_max_bytes=cap,
        counters_save_seconds=0,
    )
    with as_served(model_dir, cfg) as pc:  # a server opening the directory
        assert pc.stats()["num_pinned"] == len(doc["keys"])
        for i in range(10 * cap // (4 * 8192)):  # 10x the SSD cap of one-off prompts
            pc.prefill(prompt(100 + i, 4 * BLOCK, vocab=200))
        pc.flush()
        st = pc.stats()
        assert st["ssd"]["num_evictions"] > 0 and st["hot"]["num_evictions"] > 0
        assert pc.match(tokens) == len(tokens) - 1  # all of it, from hot
        assert pc.match(tokens_of(model_dir, TEXT.upper())) < len(other["keys"]) * BLOCK
    with as_served(model_dir, cfg) as pc:  # restarted: the pin holds from the index
        pc.trim_hot(0)
        assert pc.match(tokens) == len(tokens) - 1


def test_pin_system_pins_what_serve_restores_for_that_system_prompt(model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    doc = pin(model_dir, ssd, "--text", SYSTEM, "--system", "--ttl", "7d", "--json")
    assert doc["num_pinned_tokens"] == doc["num_tokens"] > 2 * BLOCK
    assert 7 * 86400 - 60 < doc["until"] - time.time() <= 7 * 86400
    argv = [*BASE, "serve", "--model", str(model_dir), "--ssd-dir", str(ssd)]
    argv += ["--block-size", str(BLOCK), "--mx-cache-limit", "256M"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When?"}]
    other = [{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "When?"}]
    with running(argv, tmp_path / "serve.log") as server:
        _, cached = server.chat(messages)  # the first request of a fresh server
        _, cached_other = server.chat(other)  # the control: a system prompt never pinned
    assert cached == doc["num_tokens"]
    assert cached_other < BLOCK  # the chat template's opening tokens only
    listed = cli("ls", "--pinned", "--chains", "--ssd-dir", str(ssd))
    assert "in 6d 23h" in listed and doc["keys"][-1] in listed


def test_stats_shows_bytes_written_today_and_the_budget_left(model_dir, tmp_path, llama):
    budget = 20 * 8192
    cfg = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_min_free_bytes=0,
        ssd_write_budget=budget,
        counters_save_seconds=0,
    )
    with PrefixCache(llama, cfg, model_id="m") as pc:
        for i in range(3):
            pc.prefill(prompt(i, 4 * BLOCK))
        pc.flush()
        written = pc.stats()["ssd"]["written_bytes"]
    doc = cli("stats", "--ssd-dir", str(tmp_path / "ssd"), "--json")
    assert doc["written_bytes_today"] == written > 0 and doc["write_budget"] == budget
    drained = budget * 60 / 86400  # the bucket drains evenly over the day
    assert budget - written <= doc["write_budget_left"] <= budget - written + drained
    text = cli("stats", "--ssd-dir", str(tmp_path / "ssd"))
    assert "write budget 160.0 KiB per day" in text and "written today (UTC)" in text
    free = cfg.replace(ssd_dir=str(tmp_path / "free"), ssd_write_budget=0)
    with PrefixCache(llama, free, model_id="m") as pc:
        pc.prefill(prompt(9, 2 * BLOCK))  # the control: no budget set
    doc = cli("stats", "--ssd-dir", str(tmp_path / "free"), "--json")
    assert doc["write_budget"] == 0 and doc["write_budget_left"] is None
    assert doc["written_bytes_today"] > 0 and doc["num_pinned"] == 0


def test_bad_pin_input_is_one_line_naming_the_value_and_keeps_what_is_stored(model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    doc = pin(model_dir, ssd, "--text", TEXT, "--json")
    (tmp_path / "empty.txt").write_text("  \n")
    cases = [
        (["--text", "   "], "the prompt is empty (--text)"),
        ([str(tmp_path / "empty.txt")], "empty.txt'): nothing to pin"),
        ([str(tmp_path / "missing.txt")], "missing.txt': cannot read it: No such file"),
        (["--text", TEXT, "--ttl", "0"], "--ttl must be more than 0 seconds, got 0"),
        (["--text", TEXT, "--ttl", "-5"], "not a duration (e.g. 7d, 12h, 30m): '-5'"),
        ([], "give the prompt as FILE or --text TEXT"),
    ]
    for args, message in cases:
        out = pin(model_dir, ssd, *args, code=2)
        assert message in out, (args, out)
        assert "Traceback" not in out and ("--ttl" in args or out.count("\n") == 1), out
    nope = tmp_path / "nope"
    out = cli("pin", "--text", TEXT, "--model", str(nope), "--ssd-dir", str(ssd), code=2)
    assert f"--model '{nope}' is not a model directory" in out
    base = ["--model", str(model_dir), "--ssd-dir", str(ssd), "--block-size", str(BLOCK)]
    out = cli("unpin", "--text", "never pinned", *base, code=1)
    assert "nothing of these" in out
    listed = cli("ls", "--pinned", "--ssd-dir", str(ssd), "--json")
    assert {r["key"] for r in listed["rows"]} == set(doc["keys"])  # nothing stored was lost
