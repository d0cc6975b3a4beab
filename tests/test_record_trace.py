"""``serve --record-trace``: the recorder's Mooncake lines (chain keys remapped to small
integers, a short last block with an id of its own, safe under concurrent requests),
and a served tiny model's recorded traffic replayed by ``simulate``."""

from __future__ import annotations

import json
import random
import sys
import threading

import pytest
import requests
from test_serve_e2e import TIMEOUT, running

from prefixcache.cli import main
from prefixcache.cli.demo import _texts
from prefixcache.serve.recorder import TraceRecorder
from prefixcache.tiny.models import save_model
from prefixcache.traces.reader import read_trace

BLOCK = 16


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recorder_remaps_chain_keys_in_first_seen_order(tmp_path):
    rng = random.Random(0)
    a = [rng.randrange(100_000, 200_000) for _ in range(40)]  # 2 blocks and 8 tokens
    b = a[:32] + [7] * 10  # the same two blocks, another tail
    c = [a[0] + 1, *a[1:]]  # the first token differs: nothing shared
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(str(path), BLOCK)
    for prompt, out in ((a, 5), (b, 0), (a, 3), (a[:32], 1), (c, 2), (a[:35], 4)):
        rec.record(rec.now(), prompt, out)
    rec.close()
    lines = _lines(path)
    assert [x["hash_ids"] for x in lines] == [
        [0, 1, 2],
        [0, 1, 3],
        [0, 1, 2],  # the same prompt, the same ids
        [0, 1],  # no tail: no third id
        [4, 5, 6],  # one token off in the first block: every id new
        [0, 1, 7],  # a shorter tail is another tail
    ]
    assert [x["input_length"] for x in lines] == [40, 42, 40, 32, 40, 35]
    assert [x["output_length"] for x in lines] == [5, 0, 3, 1, 2, 4]
    assert all(x["block_tokens"] == BLOCK for x in lines)
    stamps = [x["timestamp"] for x in lines]
    assert stamps == sorted(stamps) and stamps[0] >= 0
    assert not any(str(t) in path.read_text() for t in a)  # no token id is written
    # the reader takes the block size from the lines
    first = read_trace(path)[0]
    assert first.trace_block_tokens == BLOCK and first.block_tokens(BLOCK) == [16, 16, 8]


def test_recorder_under_concurrent_requests(tmp_path):
    prompts = [[i % 7] * (16 + i % 20) for i in range(40)]
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(str(path), BLOCK)
    start = threading.Barrier(8)

    def worker(w: int) -> None:
        start.wait()
        for i in range(w, 400, 8):
            rec.record(rec.now(), prompts[i % 40], i)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    lines = _lines(path)
    assert len(lines) == 400 == rec.num_requests
    by_prompt: dict[int, list[int]] = {}
    for x in lines:
        ids = by_prompt.setdefault(x["output_length"] % 40, x["hash_ids"])
        assert ids == x["hash_ids"]  # one prompt, one id list, whichever thread wrote it
    # negative control: different prompts do not share a tail id
    assert by_prompt[0][-1] != by_prompt[7][-1]
    distinct = {i for ids in by_prompt.values() for i in ids}
    assert distinct == set(range(len(distinct)))  # small integers, none skipped


def test_recorder_refuses_a_bad_block_size(tmp_path):
    with pytest.raises(ValueError, match="block_tokens must be an integer >= 1, got 0"):
        TraceRecorder(str(tmp_path / "t.jsonl"), 0)


def _chats(num_conversations: int = 3, num_turns: int = 3) -> list[list[str]]:
    """The demo's chats (its texts: a shared system prompt, one user text a turn)."""
    system, *users = _texts(1 + num_conversations * num_turns, 200)
    users = [" ".join(u.split()[:40]) for u in users]
    return [[system, *users[c::num_conversations]] for c in range(num_conversations)]


def test_recorded_traffic_replays_to_the_server_hit_rate(tmp_path, capsys):
    model = save_model(tmp_path / "llama", "llama")
    trace = tmp_path / "served.jsonl"
    argv = [sys.executable, "-m", "prefixcache", "serve", "--model", str(model)]
    argv += ["--ssd-dir", str(tmp_path / "ssd"), "--block-size", str(BLOCK)]
    prompt = cached = 0
    with running([*argv, "--record-trace", str(trace)], tmp_path / "serve.log") as server:
        chats = _chats()
        histories = [[{"role": "system", "content": c[0]}] for c in chats]
        for turn in range(1, len(chats[0])):
            for chat, history in zip(chats, histories, strict=True):
                history.append({"role": "user", "content": chat[turn]})
                body = {"messages": history, "temperature": 0, "max_tokens": 8}
                reply = requests.post(
                    f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT
                )
                reply.raise_for_status()
                data = reply.json()
                prompt += data["usage"]["prompt_tokens"]
                cached += data["usage"]["prompt_tokens_details"]["cached_tokens"]
                history.append(
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
                )
        assert server.stop() == 0
    lines = _lines(trace)
    assert len(lines) == 9 and sum(x["input_length"] for x in lines) == prompt
    argv = ["simulate", str(trace), "--shape", str(model), "--kv-bits", "32"]
    assert main([*argv, "--block-tokens", str(BLOCK), "--hot", "1G", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    served = cached / prompt
    assert served > 0.3  # shared system prompt and earlier turns
    assert abs(doc["hit_rate"] - served) <= 0.02, (doc["hit_rate"], served)
