"""The serve reuse benchmark (tools/bench_reuse_serve.py) in short: llama, tiny settings.

Three real server processes (plain mlx_lm.server, prefixcache serve, a
cache-less mlx_lm.server) answer the whole trace; the cache-less one reuses
nothing, the other two reuse in every phase with replies equal to the
reference. The controls show the reply check and the replay catch what they
are there for. vllm-mlx (an optional venv) is left out; its log reader and the
stream's first-token rule are checked on text.
"""

from __future__ import annotations

import os
import shlex
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import bench_reuse_serve
from reuselib.report import summarize
from reuselib.servers import carries_output
from reuselib.trace import Text, TraceConfig
from reuselib.vllm_mlx import ScheduleLog

ARGS = shlex.split(
    "--archs llama --conversations 2 --turns 2 --clients 2 --max-tokens 6 "
    "--system-words 60 --user-words 6 --servers mlx-lm ours"
)
NUM_SEQ, NUM_CONC, NUM_PROBES = 4, 4, 5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    args = bench_reuse_serve.setup_arg_parser().parse_args(ARGS)
    return bench_reuse_serve.run_arch("llama", args, tmp_path_factory.mktemp("reuse"))


def _by_system(result):
    return {s.system: s for s in result.summaries}


def test_every_server_answers_the_whole_trace(result):
    for s in result.summaries:
        assert not s.failure and s.num_errors == 0, s
        assert (s.seq.num_requests, s.conc.num_requests) == (NUM_SEQ, NUM_CONC), s
        assert s.probe.num_requests == NUM_PROBES, s
    # the clients' requests were in flight together (the batch path is exercised)
    assert _by_system(result)["none"].conc.num_overlapped >= 2


def test_reuse_where_a_cache_is_and_nowhere_else(result):
    s = _by_system(result)
    assert s["none"].total.cached_tokens == 0 and s["none"].probe.cached_tokens == 0
    for name in ("mlx-lm", "ours"):
        assert s[name].seq.cached_tokens > 0 and s[name].conc.cached_tokens > 0, s[name]
        cached, prompt, _ = s[name].probes["next_turn"]
        assert 0 < cached < prompt
    assert result.ours_stats["num_hits"] > 0, result.ours_stats


def test_replies_equal_the_cache_less_reference_on_llama(result):
    for s in result.summaries:
        assert s.seq.num_differ == s.conc.num_differ == s.probe.num_differ == 0, s
        assert s.total.valid_cached == s.total.cached_tokens


def test_control_a_different_reply_is_counted(result):
    records = result.records["ours"]
    ref = {r.key: r.reply for r in records}
    turn = next(r for r in records if r.phase == "seq" and r.cached_tokens > 0)
    ref[turn.key] += " and more"
    s = summarize("llama", "ours", records, ref)
    assert s.seq.num_differ == 1
    assert s.seq.valid_cached == s.seq.cached_tokens - turn.cached_tokens


def test_control_requests_the_reference_never_saw_are_replayed(result):
    # the cache-less server answered the concurrent phase batched: replayed one at a time
    conc = {r.key for r in result.records["none"] if r.phase == "conc"}
    assert result.num_replays == {"none": len(conc)} and len(conc) == NUM_CONC


def test_trace_text_is_a_function_of_the_seed():
    cfg = TraceConfig()
    assert Text(0).user(3, 1, cfg.user_words) == Text(0).user(3, 1, cfg.user_words)
    assert Text(0).user(3, 1, cfg.user_words) != Text(1).user(3, 1, cfg.user_words)
    assert Text(0).system(0, 20) != Text(0).system(1, 20)


def _schedule(request: str, prompt: int, prefill: int) -> bytes:
    cached = f", {prompt - prefill} cached" if prefill < prompt else ""
    return (
        f"INFO:vllm_mlx.scheduler:[schedule] request={request} uid=0 prompt_tokens={prompt} "
        f"tokens_to_prefill={prefill}{cached} max_tokens=16 running=1 waiting=0\n"
    ).encode()


def test_vllm_mlx_cached_tokens_come_from_the_line_of_each_request(tmp_path):
    log = tmp_path / "vllm-mlx.log"
    log.write_bytes(b"INFO: started\n" + _schedule("a", 700, 700))
    schedule = ScheduleLog(log)
    assert schedule.claim(0, 700).cached_tokens == 0
    sent = log.stat().st_size
    # two requests in flight: lines in the order the scheduler took them
    log.write_bytes(log.read_bytes() + _schedule("b", 760, 40) + _schedule("c", 720, 100))
    assert schedule.claim(sent, 720).cached_tokens == 620
    assert schedule.claim(sent, 760).cached_tokens == 720


def test_vllm_mlx_control_a_line_is_claimed_once_and_never_before_its_request(tmp_path):
    log = tmp_path / "vllm-mlx.log"
    log.write_bytes(_schedule("a", 700, 100))
    schedule = ScheduleLog(log)
    with pytest.raises(LookupError):  # written before the request was sent
        schedule.claim(log.stat().st_size, 700)
    schedule.claim(0, 700)
    with pytest.raises(LookupError):  # already given to a reply
        schedule.claim(0, 700)
    log.write_bytes(log.read_bytes() + _schedule("b", 700, 50)[:-20])  # still being written
    with pytest.raises(LookupError):
        schedule.claim(0, 700)


def test_the_first_token_is_the_first_chunk_with_output():
    def chunk(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    # vllm-mlx's stream opens with the role, before its prefill, and sends empty deltas
    assert not carries_output(chunk({"role": "assistant"}))
    assert not carries_output(chunk({}))
    assert not carries_output({"choices": [], "usage": {"prompt_tokens": 5}})
    # mlx-lm's chunks: text (with the role), or the last one, which may carry nothing
    assert carries_output(chunk({"role": "assistant", "content": "Q"}))
    assert carries_output(chunk({"role": "assistant", "reasoning": "hm"}))
    assert carries_output(chunk({"role": "assistant"}, "stop"))
