"""The server never dies of the cache: real ``prefixcache serve`` processes, real
directories made unusable, the adapter called with mlx-lm's own parameter names."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from conftest import prefill, prompt, tiny_model
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from test_serve_e2e import BLOCK_SIZE, SYSTEM, _ours, running

from prefixcache.config import CacheConfig
from prefixcache.serve.prompt_cache import TieredPromptCache
from prefixcache.tiny.models import save_model

HERE = Path(__file__).parent
KEY = ("/models/tiny", None, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("model") / "llama", "llama")


def _serve(model_dir: Path, ssd: str, port: int = 1) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--model",
        str(model_dir),
        "--ssd-dir",
        ssd,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def _read_only_dir(tmp_path: Path):
    """A directory this process cannot write: chmod 0500 for a non-root user, a
    read-only tmpfs for root (root ignores permission bits); None if neither."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)
        return
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_serve_refuses_a_path_under_a_file_before_listening(model_dir, tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    res = _serve(model_dir, str(afile / "x"))
    assert res.returncode == 2, res.stderr
    assert f"SSD tier directory {afile}/x is not usable: Not a directory" in res.stderr
    assert "Starting httpd" not in res.stderr + res.stdout  # never listened
    assert "Traceback" not in res.stderr


def test_serve_refuses_a_read_only_directory_before_listening(model_dir, tmp_path):
    with _read_only_dir(tmp_path) as path:
        if path is None:
            pytest.skip("root without mount permission: no way to make a read-only directory")
        res = _serve(model_dir, str(path / "ssd" if os.geteuid() == 0 else path))
    assert res.returncode == 2, res.stderr
    assert "is not usable: " in res.stderr and str(path) in res.stderr, res.stderr
    assert "Read-only file system" in res.stderr or "Permission denied" in res.stderr
    assert "Starting httpd" not in res.stderr + res.stdout


def test_adapter_takes_lru_prompt_cache_parameter_names():
    for name in ("fetch_nearest_cache", "insert_cache", "trim_to"):
        ours = inspect.signature(getattr(TieredPromptCache, name)).parameters
        theirs = inspect.signature(getattr(LRUPromptCache, name)).parameters
        assert list(ours) == list(theirs), name
        assert [p.kind for p in ours.values()] == [p.kind for p in theirs.values()], name


def _request(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    return cache


def test_adapter_serves_hot_only_through_an_ssd_failure_and_recovers(tmp_path, caplog):
    model = tiny_model()
    ssd = tmp_path / "ssd"
    config = CacheConfig(ssd_dir=str(ssd), block_size=16, ssd_retry_seconds=0)
    tiered = TieredPromptCache(lambda key: model, config)
    first, second, third = prompt(1, 64), prompt(2, 64), prompt(3, 64)
    with caplog.at_level(logging.INFO):
        tiered.insert_cache(model=KEY, tokens=first, prompt_cache=_request(model, first))
        tiered.trim_to(n_sequences=0)  # spill to SSD
        tiered.cache.flush()
        assert tiered.stats()["ssd"]["num_writes"] == 4
        # the payload root becomes a file: every SSD write fails from now on
        os.rename(ssd / "blocks", tmp_path / "kept")
        (ssd / "blocks").write_bytes(b"")
        tiered.insert_cache(model=KEY, tokens=second, prompt_cache=_request(model, second))
        tiered.trim_to(n_sequences=0)
        tiered.cache.flush()
        stats = tiered.stats()
        assert stats["ssd"]["enabled"] == 0 and stats["ssd"]["num_failures"] == 1, stats
        # still serving: the hot tier takes new blocks and fetches hit them
        tiered.insert_cache(model=KEY, tokens=third, prompt_cache=_request(model, third))
        cache, rest = tiered.fetch_nearest_cache(model=KEY, tokens=[*third, 5])
        assert cache is not None and len(rest) == 1
        # the cause goes away: the next spill wakes the probe, and writes resume
        os.unlink(ssd / "blocks")
        os.rename(tmp_path / "kept", ssd / "blocks")
        tiered.trim_to(n_sequences=0)
        tiered.cache.flush()
        assert tiered.stats()["ssd"]["enabled"] == 1
        fourth = prompt(4, 64)
        tiered.insert_cache(model=KEY, tokens=fourth, prompt_cache=_request(model, fourth))
        tiered.trim_to(n_sequences=0)
        tiered.close()
    closed = [r.getMessage() for r in caplog.records if "closed cache" in r.getMessage()]
    assert len(closed) == 1 and "persisted_blocks=8" in closed[0], closed
    assert "lost_blocks=" in closed[0] and "lost_blocks=0" not in closed[0], closed
    # restart: the first and fourth conversations come from SSD, the second was lost
    with TieredPromptCache(lambda key: model, config) as again:
        for tokens, hit in ((first, True), (fourth, True), (second, False)):
            cache, rest = again.fetch_nearest_cache(model=KEY, tokens=[*tokens, 5])
            assert (cache is not None) == hit and len(rest) == (1 if hit else 65)


def test_adapter_opens_hot_only_when_the_directory_is_unusable_then_retries(tmp_path):
    model = tiny_model()
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    config = CacheConfig(ssd_dir=str(afile / "ssd"), block_size=16, ssd_retry_seconds=0)
    tokens = prompt(5, 64)
    with TieredPromptCache(lambda key: model, config) as tiered:
        tiered.insert_cache(KEY, tokens, _request(model, tokens))  # no exception
        assert tiered.stats()["hot_only"] == 1 and tiered.stats()["num_storage_errors"] >= 1
        cache, rest = tiered.fetch_nearest_cache(KEY, [*tokens, 5])
        assert cache is not None and len(rest) == 1  # served from hot
        afile.unlink()  # the path can be a directory now: the next call reopens with SSD
        tiered.fetch_nearest_cache(KEY, [*tokens, 5])
        assert tiered.stats()["hot_only"] == 0 and "ssd" in tiered.stats()


def test_serve_keeps_serving_when_the_ssd_dir_breaks_and_exits_cleanly(model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    argv = [*_ours(model_dir, ssd), "--write-policy", "write_through"]  # SSD writes at once
    with running(argv, tmp_path / "serve.log") as server:
        server.chat(messages)
        os.rename(ssd / "blocks", tmp_path / "kept")
        (ssd / "blocks").write_bytes(b"")  # every SSD write fails from now on
        for i in range(3):
            other = [messages[0], {"role": "user", "content": f"Question {i}?"}]
            server.chat(other)  # raises on any HTTP error
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        _, cached = server.chat(messages)
        assert cached >= BLOCK_SIZE * 4  # the hot tier still serves
        assert server.stop() == 0
    log = server.text()
    assert "Traceback" not in log, log
    assert len([line for line in log.splitlines() if "disabled (" in line]) == 1, log
    closed = [line for line in log.splitlines() if "prefixcache: closed cache" in line]
    assert len(closed) == 1 and "SSD writes off at close" in closed[0], closed
    assert "persisted_blocks=" in closed[0] and "lost_blocks=0" not in closed[0], closed


@pytest.mark.parametrize("seconds", [0.2, 0.0])
def test_counters_survive_sigkill_after_the_save_interval(tmp_path, seconds):
    ssd = tmp_path / "ssd"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    child = subprocess.Popen(
        [sys.executable, str(HERE / "counters_child.py"), str(ssd), str(seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "done"
        assert child.stdout.readline().strip() == "waited"  # 1 s: 5 intervals
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache", "stats", "--json", "--ssd-dir", str(ssd)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    counters = json.loads(out.stdout)["counters"]
    if seconds:
        assert counters["num_fetches"] == 3 and counters["num_stores"] == 1, counters
        assert counters["cached_tokens"] == 3 * 63, counters  # one token is left to prefill
    else:  # control: without the periodic save, a killed process saved nothing
        assert counters["num_fetches"] == 0, counters
