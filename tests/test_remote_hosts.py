"""Several hosts share one prefix cache through a real redis-server.

Hosts are separate processes (or caches) with their own SSD directories; a
prefix one computed restores bit-exactly in another, the local tiers keep
serving while the server is down, and remote hits resume once it is back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from conftest import live_logits, max_diff, prefill, prompt
from mlx_lm.models.cache import make_prompt_cache

from prefixcache import CacheConfig, PrefixCache

BLOCK = 16
HERE = os.path.dirname(os.path.abspath(__file__))


def host(url: str, ssd_dir, verb: str, seed: int, num_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    args = [sys.executable, os.path.join(HERE, "remote_child.py"), url, str(ssd_dir), verb]
    done = subprocess.run(
        [*args, str(seed), str(num_tokens)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["logits"] = mx.array(np.frombuffer(bytes.fromhex(out["logits"]), np.float32))[None]
    return out


def test_a_prefix_stored_on_one_host_restores_bit_exactly_on_another(tmp_path, llama, redis_server):
    url = redis_server.url
    first = host(url, tmp_path / "a", "store", 1, 4 * BLOCK)
    assert first["stats"]["remote"]["num_writes"] == 4
    second = host(url, tmp_path / "b", "fetch", 1, 4 * BLOCK + 5)
    st = second["stats"]
    assert st["cached_tokens"] == 4 * BLOCK and st["remote_block_hits"] == 4
    assert st["ssd_block_hits"] == 0 and st["hot_block_hits"] == 0
    # the remote hit was promoted onto b's ssd; b's own 5-token tail spilled there too
    assert st["ssd"]["num_blocks"] == 5
    tokens = prompt(1, 4 * BLOCK + 5)
    assert max_diff(second["logits"], live_logits(llama, tokens, 4 * BLOCK)) == 0.0
    other = prompt(1, 4 * BLOCK + 5)
    other[3] = (other[3] + 1) % 512  # negative control: another prefix, other logits
    assert max_diff(second["logits"], live_logits(llama, other, 4 * BLOCK)) > 0


def cache_for(tmp_path, name: str, url: str, model, **changes) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / name),
        ssd_min_free_bytes=0,
        remote_url=url,
        remote_breaker_failures=1,
        remote_breaker_ms=300,
        remote_timeout_ms=500,
    )
    return PrefixCache(model, config.replace(**changes), model_id="tiny")


def filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache, step=BLOCK)
    return cache


def test_killed_server_local_tiers_keep_serving_and_remote_hits_resume(
    tmp_path, llama, redis_server
):
    a = cache_for(tmp_path, "a", redis_server.url, llama, remote_breaker_ms=1000)
    b = cache_for(tmp_path, "b", redis_server.url, llama, remote_breaker_ms=1000)
    one, two, three = (prompt(seed, 3 * BLOCK + 1) for seed in (11, 12, 13))
    a.store(one, filled(llama, one))
    a.flush()
    redis_server.kill()
    assert a.fetch(one)[1] == 3 * BLOCK  # hot keeps serving
    a.trim_hot(0)  # spilled to a's ssd
    assert a.fetch(one)[1] == 3 * BLOCK and a.stats()["ssd_block_hits"] == 3
    a.store(two, filled(llama, two))  # queued; the writer finds the server gone
    assert b.fetch(one)[1] == 0
    st = b.stats()
    assert st["miss_reasons"]["remote_unavailable"] == 1
    # the fetch's lookup failed (b's writer may have failed too, writing its namespace)
    assert st["remote"]["num_errors"] >= 1 and st["remote"]["breaker_open"] == 1
    assert b.fetch(one)[1] == 0 and b.stats()["remote"]["num_skipped"] >= 1
    a.flush()
    assert a.stats()["remote"]["num_dropped_writes"] >= 1
    redis_server.start()  # same port, empty: no persistence
    time.sleep(1.05)  # the breakers close
    a.store(three, filled(llama, three))
    a.flush()
    cache, num = b.fetch(three)
    assert num == 3 * BLOCK and b.stats()["remote_block_hits"] == 3
    want = filled(llama, three)
    assert np.array_equal(
        np.array(cache[0].keys[..., :num, :]), np.array(want[0].keys[..., :num, :])
    )
    a.close()
    b.close()


def test_cost_gate_refuses_a_remote_restore_slower_than_recomputing(tmp_path, llama, redis_server):
    a = cache_for(tmp_path, "a", redis_server.url, llama)
    tokens = [prompt(seed, 2 * BLOCK + 1) for seed in (21, 22)]
    for t in tokens:
        a.store(t, filled(llama, t))
    a.flush()
    fast = cache_for(tmp_path, "b", redis_server.url, llama, prefill_tokens_per_s=10**12)
    assert fast.fetch(tokens[0])[1] == 2 * BLOCK  # the first load measures the remote
    assert fast.fetch(tokens[1])[1] == 0  # no network is faster than 10**12 tokens/s
    st = fast.stats()
    assert st["remote"]["num_gate_refusals"] == 1
    assert st["miss_reasons"]["remote_slower_than_prefill"] == 1
    slow = cache_for(tmp_path, "c", redis_server.url, llama, prefill_tokens_per_s=1)
    assert slow.fetch(tokens[0])[1] == 2 * BLOCK and slow.fetch(tokens[1])[1] == 2 * BLOCK
    assert slow.stats()["remote"]["num_gate_refusals"] == 0
    for pc in (a, fast, slow):
        pc.close()


def test_stats_cli_reports_the_server_per_namespace(tmp_path, llama, redis_server, capsys):
    from prefixcache.cli import main
    from prefixcache.cli.serve import add_serve_args, serve_config
    from prefixcache.prometheus import prometheus_text

    with cache_for(tmp_path, "a", redis_server.url, llama) as a:
        tokens = prompt(31, 3 * BLOCK + 1)
        a.store(tokens, filled(llama, tokens))
        a.flush()
        metrics = prometheus_text(a.stats())
    assert "prefixcache_remote_writes_total 4" in metrics  # 3 blocks and the 1-token tail
    assert main(["stats", "--remote-url", redis_server.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_blocks"] == 4 and doc["nbytes"] == 3 * 8192 + 8192 // BLOCK
    assert doc["num_tokens"] == 3 * BLOCK + 1 and doc["num_forged"] == 0
    assert [(ns["model"], ns["num_blocks"]) for ns in doc["namespaces"]] == [("tiny", 4)]
    assert doc["server"]["maxmemory_policy"] == "allkeys-lru"
    assert main(["stats", "--remote-url", redis_server.url, "--remote-prefix", "other"]) == 0
    assert "0 blocks" in capsys.readouterr().out
    redis_server.kill()
    assert main(["stats", "--remote-url", redis_server.url]) == 2

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", "m", "--remote-url", "unix:///tmp/x.sock"])
    assert serve_config(args).remote_url == "unix:///tmp/x.sock"
