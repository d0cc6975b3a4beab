"""Fuzzing ``prefixcache serve`` (a real subprocess) with property-based requests.

A few hundred request bodies from ``tools/fuzzlib.cases`` (hypothesis), each
answered with 200, 400 or 413 and followed by a healthy ``/health``; then a
conversation cached before the fuzzing replies the same from its cache. At the
connection level: a body sent slowly is served, a stalled one is answered
(408) once the client timeout passes, a cut one is a 400, and a hundred idle
connections neither stop other requests nor stay open past the timeout.
``tools/fuzz_serve.py --cases N`` runs the same with many more cases.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from test_serve_e2e import _ours, model_dir, running  # noqa: F401
from test_serve_safety import answer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import fuzzlib

CLIENT_TIMEOUT = 2.0
CASES = 300


def fuzz_argv(model, ssd) -> list[str]:
    """serve with small generation limits (fuzzed requests stay quick) and a short
    client timeout."""
    limits = ["--max-tokens", "2", "--max-tokens-limit", str(fuzzlib.MAX_TOKENS)]
    return [*_ours(model, ssd), *limits, "--client-timeout", str(CLIENT_TIMEOUT)]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("fuzz")
    with running(fuzz_argv(model_dir, tmp / "ssd"), tmp / "serve.log") as server:
        yield server


def test_fuzzed_requests_never_stop_the_server(server):
    before = answer(server)
    before = answer(server)  # now from the cache
    assert before[1] > 0
    seen: set[str] = set()

    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(fuzzlib.cases())
    def one(case):
        seen.add(fuzzlib.check(server.url, case))

    one()
    assert {"200", "400"} <= seen, seen  # both kinds were drawn: the fuzzing reached generation
    assert answer(server) == before  # the cache and the generation loop as they were


def test_slow_stalled_and_cut_bodies(server):
    assert fuzzlib.slow_body(server.url) == "200"
    status, seconds = fuzzlib.stalled_body(server.url, timeout=30)
    assert status == "408" and seconds >= CLIENT_TIMEOUT * 0.9, (status, seconds)
    assert fuzzlib.cut_body(server.url) == "400"
    assert fuzzlib.health(server.url) == "200"


def test_idle_connections_are_dropped_after_the_client_timeout(server):
    with fuzzlib.idle_connections(server.url, 100) as idle:
        assert fuzzlib.health(server.url) == "200"
        assert fuzzlib.slow_body(server.url, pieces=2, pause=0) == "200"
        closed = [fuzzlib.closed_by_server(sock, CLIENT_TIMEOUT * 10) for sock in idle]
    assert all(closed), closed.count(False)
    assert fuzzlib.health(server.url) == "200"
