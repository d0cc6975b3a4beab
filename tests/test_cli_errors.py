"""Every ``prefixcache`` command given bad input, as a real console-script process.

A user error never ends in a traceback: one line on stderr naming the bad value
and where it came from (the flag, the argument or the PREFIXCACHE_* variable),
exit status 2. Two walks: every option of every command that converts its value
(read from the parser, so a new option is walked without a new line here) with
values no such option takes; and the errors that only running finds (a key or
a model that matches nothing, unusable paths, bad settings from variables).
Also: a closed pipe is a quiet exit, a misspelt variable is warned about.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import get_args

import pytest

from prefixcache.cli import COMMANDS, setup_arg_parser
from prefixcache.config import EVICTIONS, CacheConfig, Eviction
from prefixcache.tiny.models import save_model

CHILD = str(Path(__file__).with_name("cli_child.py"))
SCRIPT = Path(sys.executable).with_name("prefixcache")  # this environment's console script
EXE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "prefixcache"]
NUM_OPTIONS = 21  # options that convert their value, today
BAD_VALUES = ("zzz", "-1", "inf")  # "zzz" fits no option that converts its value


def clean_env(home: str, **extra: str) -> dict[str, str]:
    """No PREFIXCACHE_* variable of the caller, offline, and ``home`` as HOME (so a
    default SSD directory lands in the test's tmp dir)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    return env | {"HF_HUB_OFFLINE": "1", "HOME": home} | extra


def run_all(
    cases: list[tuple[tuple[str, ...], dict[str, str]]], home: str
) -> list[tuple[int, str, str]]:
    """Run each ``(args, env)`` as ``prefixcache ARGS`` (4 at a time): (status, stdout, stderr)."""

    def one(case: tuple[tuple[str, ...], dict[str, str]]) -> tuple[int, str, str]:
        args, env = case
        done = subprocess.run(
            [*EXE, *args],
            capture_output=True,
            text=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
            env=clean_env(home, **env),
        )
        return done.returncode, done.stdout, done.stderr

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, cases))


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """Paths the cases use: a cache (two models), a block key, a tiny model, a file, a dir."""
    root = tmp_path_factory.mktemp("errors")
    out = subprocess.run(
        [sys.executable, CHILD, "build", str(root / "ssd"), str(root / "tok")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    built = json.loads(out.stdout.splitlines()[-1])
    save_model(root / "tiny", "llama")
    (root / "afile").write_text("not a directory")
    (root / "plain").mkdir()
    (root / "home").mkdir()
    return {
        "ssd": str(root / "ssd"),
        "key": built["a"]["p1"][0],
        "tiny": str(root / "tiny"),
        "file": str(root / "afile"),
        "plain": str(root / "plain"),
        "missing": str(root / "missing"),
        "home": str(root / "home"),
    }


def failing_base(name: str, p: dict[str, str]) -> tuple[str, ...]:
    """Arguments with which ``name`` parses and then fails at once: a value the walked
    option accepts still ends in a one-line error (about this argument), never a run."""
    if name in ("stats", "ls", "tree", "verify", "gc", "clear"):
        return (name, "--ssd-dir", p["missing"])
    bases = {
        "show": ("show", "abcd", "--ssd-dir", p["missing"]),
        "serve": ("serve", "--model", p["missing"]),
        "demo": ("demo", "--model", p["missing"]),
        "make-model": ("make-model", p["file"]),
        "pin": ("pin", "--text", "hi", "--model", p["missing"], "--ssd-dir", p["ssd"]),
        "unpin": ("unpin", "--text", "hi", "--model", p["missing"], "--ssd-dir", p["ssd"]),
        "simulate": ("simulate", p["missing"], "--hot", "1G"),
        "replay": ("replay", p["missing"], "--model", p["tiny"], "--hot", "1M"),
        "explain": ("explain", "--text", "hi", "--model", p["missing"], "--ssd-dir", p["ssd"]),
    }
    assert name in bases, f"add a failing base for the new command {name!r}"
    return bases[name]


def converting_options() -> list[tuple[str, str]]:
    """(command, flag) of every option of every command with a ``type`` or ``choices``."""
    sub = next(a for a in setup_arg_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, action.option_strings[-1])
        for name, parser in sub.choices.items()
        for action in parser._actions
        if action.option_strings and (action.type is not None or action.choices)
    ]


def one_line(rc: int, out: str, err: str) -> str | None:
    """The error line of a clean user-error exit, else None."""
    lines = err.strip().splitlines()
    ok = rc == 2 and "Traceback" not in out + err and not out and len(lines) == 1
    return lines[0] if ok else None


def test_every_converting_option_refuses_bad_values_in_one_line(place):
    options = converting_options()
    cases = [
        ((*failing_base(name, place), f"{flag}={bad}"), {})
        for name, flag in options
        for bad in BAD_VALUES
    ]
    failures = []
    for (args, _), result in zip(cases, run_all(cases, place["home"]), strict=True):
        line = one_line(*result)
        expected = args[-1].partition("=")[0] if args[-1].endswith("=zzz") else "prefixcache"
        if line is None or not line.startswith(f"prefixcache {args[0]}: ") or expected not in line:
            failures.append((args, result))
    assert not failures, failures
    assert len(options) >= NUM_OPTIONS  # the walk is not empty


def semantic_cases(p: dict[str, str]) -> list[tuple[tuple[str, ...], dict[str, str], str]]:
    """(args, env, what the error line names) for errors that only running finds."""
    d = ("--ssd-dir", p["ssd"])
    model = ("serve", "--model", p["tiny"])
    redis_down = ("stats", "--remote-url", "redis://127.0.0.1:1")  # nothing listens on port 1
    return [
        (("stats", "--ssd-dir", p["file"]), {}, f"--ssd-dir {p['file']}"),
        (("stats",), {"PREFIXCACHE_SSD_DIR": p["missing"]}, "PREFIXCACHE_SSD_DIR="),
        (("stats", "--remote-url", "ftp://x"), {}, "--remote-url: remote_url must start"),
        ((*redis_down, "--remote-prefix", "a b"), {}, "--remote-prefix: remote_prefix"),
        (redis_down, {"PREFIXCACHE_REMOTE_PREFIX": "a b"}, "PREFIXCACHE_REMOTE_PREFIX='a b'"),
        (redis_down, {}, "remote server redis://127.0.0.1:1"),
        (("ls", *d, "--model", "no/such"), {}, "no model matches --model 'no/such'"),
        (("stats", *d, "--tenant", "nobody"), {}, "--tenant 'nobody'"),
        (("ls", "--ssd-dir", p["plain"]), {}, "is not a prefixcache SSD tier"),
        (("show", "zzzz", *d), {}, "'zzzz' is not a block key"),
        (("show", "ffff", *d), {}, "no block matches 'ffff'"),
        (("show", p["key"], *d, "--tokenizer", p["missing"]), {}, "--tokenizer"),
        (("tree", *d, "--model", "no/such"), {}, "--model 'no/such'"),
        (("verify", "--ssd-dir", p["plain"]), {}, f"--ssd-dir {p['plain']}"),
        (("gc", *d, "--model", "no/such"), {}, "--model 'no/such'"),
        (("gc", *d, "--all", "--older-than", "1d"), {}, "--older-than: not allowed with"),
        (("clear", *d), {}, "refusing without --yes"),
        (("clear", *d, "--model", "no/such", "--yes"), {}, "--model 'no/such'"),
        (model, {"PREFIXCACHE_BLOCK_SIZE": "abc"}, "PREFIXCACHE_BLOCK_SIZE='abc': not an int"),
        (model, {"PREFIXCACHE_BLOCK_SIZE": "0"}, "PREFIXCACHE_BLOCK_SIZE='0': block_size"),
        (model, {"PREFIXCACHE_HOT_MAX_BYTES": "inf"}, "PREFIXCACHE_HOT_MAX_BYTES='inf'"),
        # read once by every command, whether or not it uses the setting
        (("stats", *d), {"PREFIXCACHE_HOT_MAX_BYTES": "inf"}, "PREFIXCACHE_HOT_MAX_BYTES='inf'"),
        (("ls", *d), {"PREFIXCACHE_BLOCK_SIZE": "x"}, "PREFIXCACHE_BLOCK_SIZE='x'"),
        (("verify", *d), {"PREFIXCACHE_WRITE_POLICY": "?"}, "PREFIXCACHE_WRITE_POLICY='?'"),
        (model, {"PREFIXCACHE_COUNTERS_SAVE_SECONDS": "nan"}, "SAVE_SECONDS='nan'"),
        (model, {"PREFIXCACHE_WRITE_POLICY": "later"}, "PREFIXCACHE_WRITE_POLICY='later'"),
        (model, {"PREFIXCACHE_REMOTE_URL": "ftp://x"}, "PREFIXCACHE_REMOTE_URL='ftp://x'"),
        ((*model, "--block-size", "0"), {}, "--block-size: block_size must be a positive"),
        ((*model, "--remote-timeout-ms", "0"), {}, "--remote-timeout-ms: remote_timeout_ms"),
        ((*model, "--ssd-dir", p["file"]), {}, p["file"]),
        ((*model, "--kv-bits", "7", "--port", "0"), {}, "--kv-bits: kv_bits must be"),
        ((*model, "--hot-tenant-floors", "b"), {}, "--hot-tenant-floors: hot_tenant_floors='b'"),
        ((*model, "--hot-tenant-caps", "b=1K", "--hot-tenant-floors", "b=2K"), {}, "cap 1024"),
        (model, {"PREFIXCACHE_HOT_TENANT_FLOORS": "b=9T"}, "PREFIXCACHE_HOT_TENANT_FLOORS='b=9T'"),
        ((*model, "--ssd-tenant-floors", "b=9T"), {}, "--ssd-tenant-floors: ssd_tenant_floors:"),
        ((*model, "--ssd-tenant-caps", "a=1K,a=2K"), {}, "ssd_tenant_caps='a=1K,a=2K'"),
        ((*model, "--remote-tenant-floors", "b=1K"), {}, "above remote_max_bytes=0"),
        ((*model, "--tenant-header", "X Tenant"), {}, "--tenant-header 'X Tenant'"),
        (("serve", "--model", p["missing"]), {}, f"--model '{p['missing']}'"),
        ((*model, "--record-trace", f"{p['missing']}/t.jsonl"), {}, "--record-trace"),
        (("demo", "--model", p["missing"]), {}, f"--model '{p['missing']}'"),
        (("make-model", p["file"]), {}, f"'{p['file']}' exists and is not a directory"),
        (("pin", "--text", "hi", "--model", p["missing"], *d), {}, f"--model '{p['missing']}'"),
        (("pin", "--model", p["tiny"], *d), {}, "give the prompt as FILE or --text"),
        (("pin", "--text", "hi", "--model", p["tiny"], "--ttl", "-5"), {}, "--ttl"),
        (("unpin", "--text", "hi", "--model", p["missing"], *d), {}, f"--model '{p['missing']}'"),
        (("make-model", p["plain"], "--arch", "nonsense"), {}, "--arch: invalid choice"),
        (("explain", "--text", "hi", "--model", p["missing"], *d), {}, f"--model '{p['missing']}'"),
        (("explain", "--model", p["tiny"], *d), {}, "give the prompt as FILE or --text"),
        (("explain", "--text", "hi", "--model", p["tiny"], "--ssd-dir", p["plain"]), {}, "is not"),
        (("simulate", p["missing"], "--hot", "1G"), {}, p["missing"]),
        (("simulate", p["file"], "--hot", "1G"), {}, f"{p['file']}: line 1: not JSON"),
        (("simulate", p["file"], "--shape", "nosuch"), {}, "unknown shape 'nosuch'"),
        (("simulate", p["file"], "--sweep", "disk=1G"), {}, "--sweep: expected TIER=SIZE"),
        (("replay", p["file"], "--model", p["tiny"], "--hot", "1M"), {}, "line 1: not JSON"),
        (("replay", p["file"], "--model", p["missing"]), {}, f"--model '{p['missing']}'"),
        (("ls", *d, "--no-such-flag"), {}, "unrecognized arguments: --no-such-flag"),
        (("nosuch",), {}, "invalid choice: 'nosuch'"),
        ((), {}, "required: COMMAND"),
    ]


def test_errors_found_when_running_are_one_line_naming_the_value(place):
    cases = semantic_cases(place)
    assert {args[0] for args, _, _ in cases if args} >= set(COMMANDS)
    results = run_all([(args, env) for args, env, _ in cases], place["home"])
    failures = [
        (args, env, says, result)
        for (args, env, says), result in zip(cases, results, strict=True)
        if (line := one_line(*result)) is None or says not in line
    ]
    assert not failures, failures
    # the control: the same commands with good input succeed (so the walk tests errors)
    d = ("--ssd-dir", place["ssd"])
    good = [
        (("ls", *d, "--model", "tiny/model-a"), {}),
        (("show", place["key"], *d), {}),
        (("gc", *d, "--model", "tiny/model-a", "--dry-run"), {}),
    ]
    assert [rc for rc, _, _ in run_all(good, place["home"])] == [0, 0, 0]


def without_reader(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` with stdout a pipe whose read end is closed before it starts, so
    its first write fails whatever the timing; (exit status, stderr)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(cmd, stdout=write, stderr=subprocess.PIPE, env=env)
    finally:
        os.close(write)
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


def test_a_closed_pipe_is_a_quiet_exit(place):
    """``ls | head`` with the reader gone before the output: exit 141, nothing on stderr.
    The control: a Python program without the handling prints a traceback there."""
    d = ("--ssd-dir", place["ssd"])
    for args in (("ls", *d), ("stats", *d), ("tree", *d), ("ls", *d, "--json")):
        rc, err = without_reader([*EXE, *args], clean_env(place["home"]))
        assert rc == 141 and err == "", (args, err)
    rc, err = without_reader([sys.executable, "-c", "print('x' * 100)"])
    assert "BrokenPipeError" in err and rc != 0


def test_a_misspelt_variable_is_warned_and_the_command_still_runs(place):
    misspelt = {"PREFIXCACHE_BLOCKSIZE": "16", "PREFIXCACHE_SSD_DIR": place["ssd"]}
    right = {"PREFIXCACHE_BLOCK_SIZE": "16", "PREFIXCACHE_SSD_DIR": place["ssd"]}
    cases = [(("stats",), misspelt), (("stats",), right)]
    (rc, out, err), (rc2, _, err2) = run_all(cases, place["home"])
    assert rc == 0 and "9 blocks" in out
    assert err.strip() == (
        "PREFIXCACHE_BLOCKSIZE is not a prefixcache setting and is ignored; "
        "did you mean PREFIXCACHE_BLOCK_SIZE?"
    )
    assert rc2 == 0 and err2 == ""  # the control: spelt right, no warning


@pytest.mark.parametrize("policy", EVICTIONS)
def test_serve_and_replay_take_every_eviction_the_library_has(policy):
    """Every policy CacheConfig accepts is a choice of ``--eviction`` (``fifo`` was
    named in serve's help and refused); control: a name no policy has is refused."""
    assert policy in get_args(Eviction)
    CacheConfig(eviction=policy)
    parser = setup_arg_parser()
    assert parser.parse_args(["serve", "--model", "m", "--eviction", policy]).eviction == policy
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--eviction", "mru"])
