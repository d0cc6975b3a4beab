"""The inspection CLI as a real console script against a cache a real PrefixCache made.

The cache (tests/cli_child.py): ``tiny/model-a`` holds two 64-token prompts
that share 2 blocks and then fork (6 blocks), ``tiny/model-b`` one 48-token
prompt (3 blocks); block_size 16. Each test that changes the directory works
on its own copy. Also: the Prometheus exposition and the metrics endpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import lmdb
import pytest
from conftest import prompt

from prefixcache import CacheConfig, PrefixCache, prometheus_text
from prefixcache.cli import main
from prefixcache.cli.common import parse_duration
from prefixcache.cli.report import format_age, format_bytes
from prefixcache.errors import MissReason
from prefixcache.serve.metrics import CONTENT_TYPE, MetricsServer
from prefixcache.tiers.ssd.admin.view import SsdView
from prefixcache.tiers.ssd.tier import SsdTier

CHILD = str(Path(__file__).with_name("cli_child.py"))
EXE = shutil.which("prefixcache")
BASE = [EXE] if EXE else [sys.executable, "-m", "prefixcache"]
A, B = "tiny/model-a", "tiny/model-b"


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*BASE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def cli(*args: str, code: int = 0, env: dict | None = None) -> str:
    """Run ``prefixcache ARGS``; check the exit status; stdout (parsed if --json)."""
    rc, out, err = finish(start(*args, env=env))
    assert rc == code, (args, rc, out, err)
    return json.loads(out) if "--json" in args and rc in (0, 1) and out else out + err


def cli_all(*calls: tuple[str, ...]) -> list:
    """Several read-only commands at once (each one is mostly interpreter start-up)."""
    procs = [start(*args) for args in calls]
    results = []
    for args, proc in zip(calls, procs, strict=True):
        rc, out, err = finish(proc)
        assert rc in (0, 1), (args, rc, out, err)
        results.append(json.loads(out) if "--json" in args else out)
    return results


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(cache directory, tokenizer directory, what the builder stored)."""
    root = tmp_path_factory.mktemp("cli")
    ssd, tok = root / "ssd", root / "tok"
    out = subprocess.run(
        [sys.executable, CHILD, "build", str(ssd), str(tok)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return ssd, tok, json.loads(out.stdout.splitlines()[-1])


@pytest.fixture
def copy(made, tmp_path):
    """A private copy of the cache directory."""
    shutil.copytree(made[0], tmp_path / "ssd")
    return str(tmp_path / "ssd")


def file_bytes(ssd, keys) -> int:
    return sum(os.path.getsize(Path(ssd) / "blocks" / k[:2] / f"{k}.safetensors") for k in keys)


def a_keys(built) -> set[str]:
    return set(built["a"]["p1"]) | set(built["a"]["p2"])


def set_last_used(ssd: str, keys, age: float) -> None:
    with SsdView(ssd, writable=True) as view:
        view.index.touch([bytes.fromhex(k) for k in keys], time.time() - age)


# -- read commands --------------------------------------------------------------


def test_stats_per_model_with_persisted_counters(made):
    ssd, _, built = made
    d = ("--ssd-dir", str(ssd))
    doc, text = cli_all(("stats", *d, "--json"), ("stats", *d))
    assert doc["format"] == {"name": "prefixcache-ssd", "version": 3}
    assert doc["num_blocks"] == 9 and doc["num_tokens"] == 144
    models = {m["model"]: m for m in doc["models"]}
    assert set(models) == {A, B}
    a, b = models[A], models[B]
    assert (a["num_blocks"], a["num_tokens"]) == (6, 96)
    assert (b["num_blocks"], b["num_tokens"]) == (3, 48)
    assert a["nbytes"] == file_bytes(ssd, a_keys(built))
    assert b["nbytes"] == file_bytes(ssd, built["b"]["p3"])
    assert doc["nbytes"] == a["nbytes"] + b["nbytes"]
    live = built["a"]["stats"]  # the counters the server process had at close
    for name in ("num_fetches", "num_hits", "prompt_tokens", "cached_tokens", "hot_block_hits"):
        assert a["counters"][name] == live[name], name
    assert a["counters"]["cached_tokens"] == 96  # 32 (p2 after p1) + 64 (the full hit)
    assert a["counters"]["miss_reasons"] == live["miss_reasons"]
    assert b["counters"]["num_fetches"] == 1 and b["counters"]["num_hits"] == 0
    assert doc["max_bytes"] == CacheConfig().ssd_max_bytes and doc["min_free_bytes"] == 0
    assert doc["disk"]["free_bytes"] > 0 and doc["other_pids"] == []
    assert re.search(r"tiny/model-a\s+6\s+96\s+\d+\.\d KiB\s+3\s+2\s+96/195", text), text


def test_ls_filters_sorts_and_lists_chains(made):
    ssd, _, built = made
    d = ("--ssd-dir", str(ssd), "--json")
    only_b, chains, limited, big = cli_all(
        ("ls", *d, "--model", B),
        ("ls", *d, "--chains", "--sort", "tokens"),
        ("ls", *d, "--limit", "2", "--sort", "size"),
        ("ls", *d, "--min-bytes", "1M"),
    )
    assert {r["key"] for r in only_b["rows"]} == set(built["b"]["p3"])
    assert {r["model"] for r in only_b["rows"]} == {B}
    assert chains["kind"] == "chains" and chains["num_matched"] == 3
    assert [r["prefix_tokens"] for r in chains["rows"]] == [64, 64, 48]
    leaves = {built["a"]["p1"][-1], built["a"]["p2"][-1], built["b"]["p3"][-1]}
    assert {r["key"] for r in chains["rows"]} == leaves
    assert all(r["complete"] for r in chains["rows"])
    assert limited["num_matched"] == 9 and len(limited["rows"]) == 2
    assert big["num_matched"] == 0 and big["rows"] == []
    fork = built["a"]["p1"][1]
    assert {r["key"]: r["num_children"] for r in limited["rows"] + only_b["rows"]}.get(fork, 2) == 2


def test_show_prints_the_chain_token_ids_and_text(made):
    ssd, tok, built = made
    key = built["a"]["p2"][3]
    text, doc = cli_all(
        ("show", key[:10], "--ssd-dir", str(ssd), "--tokenizer", str(tok), "--full"),
        ("show", key, "--ssd-dir", str(ssd), "--json", "--full"),
    )
    ids = built["ids"]["p2"]
    assert [c["key"] for c in doc["chain"]] == built["a"]["p2"] and doc["complete"]
    assert doc["tokens"] == ids[48:64] and doc["prefix_token_ids"] == ids
    assert doc["model"] == A and doc["namespace"]["model"] == A and doc["text"] is None
    assert all(k in text for k in built["a"]["p2"])
    assert " ".join(map(str, ids[48:64])) in text
    from tokenizers import Tokenizer

    words = Tokenizer.from_file(str(tok / "tokenizer.json")).decode(ids[48:64])
    assert f"text: {words!r}" in text and len(words.strip()) > 5
    cli("show", "ffff" * 8, "--ssd-dir", str(ssd), code=2)


def test_tree_shows_where_prompts_fork(made):
    ssd, _, built = made
    doc, text = cli_all(("tree", "--ssd-dir", str(ssd), "--json"), ("tree", "--ssd-dir", str(ssd)))
    trees = {ns["model"]: ns for ns in doc["namespaces"]}
    (shared,) = trees[A]["tree"]
    assert shared["first_key"] == built["a"]["p1"][0] and shared["num_blocks"] == 2
    assert shared["end_token"] == 32 and len(shared["children"]) == 2
    assert sorted(c["last_key"] for c in shared["children"]) == sorted(
        [built["a"]["p1"][3], built["a"]["p2"][3]]
    )
    assert all(c["start_token"] == 32 and c["end_token"] == 64 for c in shared["children"])
    assert trees[A]["num_chains"] == 2 and trees[A]["num_forks"] == 1
    (only,) = trees[B]["tree"]
    assert only["num_blocks"] == 3 and only["children"] == [] and trees[B]["num_forks"] == 0
    section = text.split(B)[0] if text.index(A) < text.index(B) else text.split(A)[1]
    assert "tokens 0-32  2 blocks" in section and "fork: 2 ways" in section
    assert section.count("tokens 32-64") == 2


def test_show_escapes_control_characters_of_decoded_tokens(made, tmp_path):
    ssd, tok, built = made
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    def word(i: int) -> str:  # clear screen, set title, bell, C1 CSI, carriage return
        return f"\x1b[2J\x1b]0;{i}\x07\x9b{i}\r"

    size = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size()
    evil = Tokenizer(WordLevel({word(i): i for i in range(size)}, unk_token=word(0)))
    evil.save(str(tmp_path / "evil.json"))
    key = built["a"]["p1"][1]
    d = ("--ssd-dir", str(ssd), "--tokenizer", str(tmp_path / "evil.json"), "--full")
    (rc, text, _), (rc_json, out, _) = map(
        finish, [start("show", key, *d), start("show", key, *d, "--json")]
    )
    assert rc == rc_json == 0
    for printed in (text, out):
        assert not [c for c in printed if not c.isprintable() and c != "\n"], printed
    assert "\\x1b[2J\\x1b]0;" in text and "\\x07\\x9b" in text and "\\r" in text
    doc = json.loads(out)
    ids = built["ids"]["p1"]
    assert doc["text"] == " ".join(word(i) for i in ids[16:32])
    assert doc["prefix_text"] == " ".join(word(i) for i in ids[:32])


def test_recorded_model_ids_are_printed_escaped(copy):
    root = bytes.fromhex(cli("ls", "--ssd-dir", copy, "--model", B, "--json")["rows"][0]["root"])
    with SsdView(copy, writable=True) as view:
        view.records.note_namespace(root, json.dumps({"model": "tiny/\x1b[31mred\x1b[0m"}))
    d = ("--ssd-dir", copy)
    doc, *texts = cli_all(("stats", *d, "--json"), ("stats", *d), ("ls", *d), ("tree", *d))
    assert "tiny/\x1b[31mred\x1b[0m" in {m["model"] for m in doc["models"]}
    for text in texts:
        assert "\x1b" not in text and "tiny/\\x1b[31mred\\x1b[0m" in text, text


def snapshot(ssd: str) -> dict[str, tuple[int, int, bytes]]:
    """Size, mtime and bytes of every file but LMDB's lock file (readers take slots there)."""
    out = {}
    for path in sorted(Path(ssd).rglob("*")):
        if path.is_file() and path.name != "lock.mdb":
            st = path.stat()
            out[str(path.relative_to(ssd))] = (st.st_size, st.st_mtime_ns, path.read_bytes())
    return out


def threads_started(fn) -> set[str]:
    """Names of the Python threads that ran while ``fn`` ran (started by it)."""
    seen: set[str] = set()
    threading.setprofile(lambda *_: seen.add(threading.current_thread().name))
    try:
        fn()
    finally:
        threading.setprofile(None)
    return seen


def test_read_only_commands_start_no_thread_and_write_nothing(made, copy, capsys):
    _, _, built = made
    key = built["a"]["p2"][3]
    d = ("--ssd-dir", copy)
    reads = [
        ("stats", *d),
        ("stats", *d, "--json"),
        ("ls", *d, "--chains"),
        ("tree", *d),
        ("show", key, *d, "--full"),
        ("verify", *d, "--no-progress"),
        ("gc", *d, "--older-than", "0", "--dry-run"),
    ]
    before = snapshot(copy)
    codes: list[int] = []
    for argv in reads:
        assert threads_started(lambda a=argv: codes.append(main(list(a)))) == set(), argv
    assert codes == [0] * len(reads)
    with SsdView(copy) as view:  # what they open: LMDB read-only
        assert view.index.totals()["num_blocks"] == 9
        with pytest.raises(lmdb.ReadonlyError):
            view.index.touch([bytes.fromhex(key)], 0.0)
    assert snapshot(copy) == before
    assert "would remove 9 blocks" in capsys.readouterr().out  # --dry-run saw them all
    # Negative controls: the full tier starts its writer thread; gc writes the index.
    config = CacheConfig(ssd_dir=copy, ssd_max_bytes=0, ssd_min_free_bytes=0)
    assert threads_started(lambda: SsdTier(config, record_limits=False).close())
    assert threads_started(lambda: main(["gc", *d, "--json"])) == set()
    assert snapshot(copy) != before


def test_inspection_commands_do_not_import_mlx_lm(made):
    ssd, _, built = made
    probe = (
        "import sys\n"
        "from prefixcache.cli import main\n"
        "assert main(sys.argv[1:]) == 0\n"
        "heavy = lambda: [m for m in ('mlx_lm', 'transformers') if m in sys.modules]\n"
        "print('before', heavy(), file=sys.stderr)\n"
        "import prefixcache.cli.demo\n"  # the control: the probe sees mlx-lm once imported
        "print('after', heavy(), file=sys.stderr)\n"
    )
    calls = [("stats",), ("show", built["a"]["p1"][0]), ("tree",), ("verify",)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", probe, *c, "--ssd-dir", str(ssd)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in calls
    ]
    for call, proc in zip(calls, procs, strict=True):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (call, err)
        before, after = err.splitlines()[-2:]
        assert before == "before []" and after.startswith("after ['mlx_lm'"), (call, err)


# -- commands that change the directory ---------------------------------------------


def test_verify_finds_a_corrupted_payload(made, copy):
    _, _, built = made
    assert cli("verify", "--ssd-dir", copy, "--json")["ok"]
    bad = built["a"]["p1"][2]
    path = Path(copy) / "blocks" / bad[:2] / f"{bad}.safetensors"
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # flip array bytes, size unchanged
    path.write_bytes(bytes(data))
    doc = cli("verify", "--ssd-dir", copy, "--json", code=1)
    assert [b["key"] for b in doc["bad"]] == [bad] and "checksum" in doc["bad"][0]["reason"]
    assert doc["num_quarantined"] == 0 and path.exists()
    doc = cli("verify", "--ssd-dir", copy, "--json", "--quarantine", code=1)
    assert doc["bad"][0]["quarantined"] and not path.exists()
    # p1's last block now hangs off a missing parent: reported, exit status 1
    assert [d["key"] for d in doc["detached"]] == [built["a"]["p1"][3]]
    out = cli("verify", "--ssd-dir", copy, code=1)
    assert "DETACHED" in out and "PROBLEMS FOUND" in out
    stats = cli("stats", "--ssd-dir", copy, "--json")
    assert stats["num_blocks"] == 8 and stats["num_corrupt_total"] == 1


def test_gc_older_than_takes_descendants_and_dry_run_removes_nothing(made, copy):
    _, _, built = made
    old = [*built["b"]["p3"], built["a"]["p2"][2]]  # p2's block 3 stays recent
    set_last_used(copy, old, 8 * 86400)
    want = {*old, built["a"]["p2"][3]}
    dry = cli("gc", "--ssd-dir", copy, "--older-than", "7d", "--dry-run", "--json")
    assert set(dry["keys"]) == want and dry["num_selected"] == 4 and dry["num_descendants"] == 1
    assert dry["nbytes"] == file_bytes(copy, want)
    assert cli("stats", "--ssd-dir", copy, "--json")["num_blocks"] == 9
    done = cli("gc", "--ssd-dir", copy, "--older-than", "7d", "--json")
    assert set(done["keys"]) == want and not done["dry_run"]
    left = cli("ls", "--ssd-dir", copy, "--json")
    assert {r["key"] for r in left["rows"]} == set(built["a"]["p1"])
    assert not any((Path(copy) / "blocks" / k[:2] / f"{k}.safetensors").exists() for k in want)


def test_gc_model_is_a_filter_and_all_removes_every_block_of_it(made, copy):
    """``--model`` alone selects nothing (it only scopes the criteria); ``--all`` with it
    removes that model's blocks and no other's; without ``--model``, everything."""
    _, _, built = made
    rc, out, err = finish(start("gc", "--ssd-dir", copy, "--model", B, "--json"))
    assert rc == 0 and json.loads(out)["keys"] == [] and "add --all" in err
    assert cli("stats", "--ssd-dir", copy, "--json")["num_blocks"] == 9
    old = cli("gc", "--ssd-dir", copy, "--model", B, "--older-than", "1h", "--json")
    assert old["keys"] == []  # the filter combines: nothing of B is an hour old
    set_last_used(copy, [*built["b"]["p3"], *built["a"]["p1"]], 7200)
    old = cli("gc", "--ssd-dir", copy, "--model", B, "--older-than", "1h", "--dry-run", "--json")
    assert set(old["keys"]) == set(built["b"]["p3"])  # A's old blocks are outside the scope
    doc = cli("gc", "--ssd-dir", copy, "--model", B, "--all", "--json")
    assert set(doc["keys"]) == set(built["b"]["p3"]) and doc["num_selected"] == 3
    assert cli("stats", "--ssd-dir", copy, "--json")["num_blocks"] == 6
    everything = cli("gc", "--ssd-dir", copy, "--all", "--dry-run", "--json")
    assert set(everything["keys"]) == a_keys(built)
    out = cli("gc", "--ssd-dir", copy, "--all", "--older-than", "1d", code=2)
    assert "not allowed with argument --all" in out


def test_gc_by_model_and_down_to_a_size(made, copy):
    _, _, built = made
    doc = cli("gc", "--ssd-dir", copy, "--model", B, "--all", "--json")
    assert set(doc["keys"]) == set(built["b"]["p3"])
    set_last_used(copy, built["a"]["p1"], 86400)  # p1's own blocks are the LRU ones
    keep = [*built["a"]["p1"][:2], *built["a"]["p2"][2:]]
    cap = str(file_bytes(copy, keep))
    doc = cli("gc", "--ssd-dir", copy, "--model", A, "--max-bytes", cap, "--json")
    assert set(doc["keys"]) == set(built["a"]["p1"][2:]) and doc["num_evicted"] == 2
    left = cli("ls", "--ssd-dir", copy, "--json")
    assert {r["key"] for r in left["rows"]} == set(keep)
    out = cli("gc", "--ssd-dir", copy, "--model", "no/such-model", code=2)
    assert "no model matches --model 'no/such-model'" in out and A in out


def test_clear_asks_and_removes_only_that_model(made, copy):
    _, _, built = made
    out = cli("clear", "--ssd-dir", copy, code=2)  # stdin is not a terminal, no --yes
    assert "--yes" in out
    doc = cli("clear", "--ssd-dir", copy, "--model", A, "--yes", "--json")
    assert doc["num_blocks"] == 6
    stats = cli("stats", "--ssd-dir", copy, "--json")
    assert [(m["model"], m["num_blocks"]) for m in stats["models"]] == [(B, 3)]
    assert file_bytes(copy, built["b"]["p3"]) == stats["nbytes"]
    assert cli("clear", "--ssd-dir", copy, "--yes", "--json")["num_blocks"] == 3
    assert cli("stats", "--ssd-dir", copy, "--json")["num_blocks"] == 0


def answer_on_a_tty(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run ``prefixcache ARGS`` on a pseudo-terminal and answer its question."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the command
        os.execvp(BASE[0], [*BASE, *args])
    out = b""
    while b"[y/N]" not in out:
        chunk = os.read(fd, 1024)  # OSError (EIO) if the child exits without asking
        assert chunk, out
        out += chunk
    os.write(fd, answer)
    with contextlib.suppress(OSError):  # EIO once the child has exited
        while chunk := os.read(fd, 1024):
            out += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode().replace("\r", "")


def test_clear_confirms_on_a_terminal(copy):
    rc, out = answer_on_a_tty(["clear", "--ssd-dir", copy, "--model", B], b"n\n")
    assert rc == 1 and "Remove 3 blocks" in out and "nothing removed" in out
    rc, out = answer_on_a_tty(["clear", "--ssd-dir", copy, "--model", B], b"y\n")
    assert rc == 0 and "removed 3 blocks" in out
    assert cli("stats", "--ssd-dir", copy, "--json")["num_blocks"] == 6


def test_unusable_directories_are_refused(copy, tmp_path):
    missing = tmp_path / "nothing-here"
    foreign = tmp_path / "other"
    shutil.copytree(copy, foreign)
    env = lmdb.open(str(foreign / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    env_dir = {**os.environ, "PREFIXCACHE_SSD_DIR": copy}
    procs = [
        start("stats", "--ssd-dir", str(missing)),
        start("ls", "--ssd-dir", str(foreign)),
        start("stats", "--json", env=env_dir),
    ]
    (rc1, _, err1), (rc2, _, err2), (rc3, out3, _) = map(finish, procs)
    assert rc1 == 2 and "no SSD tier directory" in err1 and not missing.exists()
    assert rc2 == 2 and "version 99" in err2 and "reads prefixcache-ssd versions 1, 2, 3" in err2
    assert rc3 == 0 and json.loads(out3)["ssd_dir"] == copy


def test_a_reader_runs_while_another_process_writes(copy, tmp_path):
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, CHILD, "write", copy, str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().startswith("stored")
        seen = []
        for _ in range(3):
            doc = cli("stats", "--ssd-dir", copy, "--json")
            seen.append(doc["num_blocks"])
            assert writer.pid in doc["other_pids"]
        stop.touch()
        lines = writer.stdout.read().splitlines()
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert writer.returncode == 0 and lines[-1] == "done"
    stored = int(lines[-2].split()[1])
    assert seen == sorted(seen) and 9 < seen[0] <= seen[-1] <= 9 + 3 * stored
    doc = cli("stats", "--ssd-dir", copy, "--json")
    models = {m["model"]: m for m in doc["models"]}
    assert doc["num_blocks"] == 9 + 3 * stored and doc["other_pids"] == []
    assert models["tiny/model-c"]["counters"]["num_fetches"] == stored


# -- metrics, logging, formatting ------------------------------------------------------

_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"\})? (-?[0-9.]+(?:e[+-]?[0-9]+)?)'
)


def parse_prometheus(text: str) -> dict[str, tuple[str, list[float]]]:
    """A strict reader of the text format: name -> (type, sample values)."""
    families: dict[str, tuple[str, list[float]]] = {}
    helps: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in helps, f"second HELP for {name}"
            helps.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in families and kind in ("counter", "gauge"), line
            assert (kind == "counter") == name.endswith("_total"), line
            families[name] = (kind, [])
        else:
            match = _SAMPLE.fullmatch(line)
            assert match and match.group(1) in families, f"bad sample line {line!r}"
            families[match.group(1)][1].append(float(match.group(3)))
    assert helps == set(families)
    return families


def test_prometheus_text_and_the_metrics_endpoint(llama, tmp_path, caplog):
    cfg = CacheConfig(block_size=16, ssd_dir=str(tmp_path / "ssd"), ssd_min_free_bytes=0)
    tokens = prompt(1, 40)
    with caplog.at_level(logging.INFO, logger="prefixcache"), PrefixCache(llama, cfg) as pc:
        for _ in range(3):  # requests: no INFO line each
            pc.prefill(tokens)
        pc.flush()
        families = parse_prometheus(prometheus_text(pc.stats()))
        with MetricsServer(pc.stats) as server:
            url = f"http://127.0.0.1:{server.port}"
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                assert resp.headers["Content-Type"] == CONTENT_TYPE
                assert parse_prometheus(resp.read().decode()).keys() == families.keys()
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(url + "/", timeout=10)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert logged == [f"prefixcache: metrics at {url}/metrics"]  # none per request or scrape
    assert families["prefixcache_fetches_total"] == ("counter", [3.0])
    assert families["prefixcache_hot_bytes"][0] == "gauge"
    assert families["prefixcache_ssd_written_bytes_total"][0] == "counter"
    assert len(families["prefixcache_misses_by_reason_total"][1]) == len(MissReason)
    assert not [n for n in families if "nbytes" in n or n.endswith("_total_total")]


def test_serve_metrics_port_and_stats_after_the_server_stopped(tmp_path):
    from test_serve_e2e import SYSTEM, running

    from prefixcache.tiny.models import save_model

    model, ssd = save_model(tmp_path / "model", "llama"), str(tmp_path / "ssd")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [
        *BASE,
        "serve",
        "--model",
        str(model),
        "--ssd-dir",
        ssd,
        "--block-size",
        "16",
        "--metrics-port",
        str(port),
    ]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When?"}]
    with running(argv, tmp_path / "serve.log") as server:
        server.chat(messages)
        _, cached = server.chat(messages)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            families = parse_prometheus(resp.read().decode())
        live = cli("stats", "--ssd-dir", ssd, "--json")
    assert cached > 0 and server.proc.returncode == 0
    assert families["prefixcache_fetches_total"] == ("counter", [2.0])
    assert families["prefixcache_cached_tokens_total"] == ("counter", [float(cached)])
    assert live["other_pids"] == [server.proc.pid]
    doc = cli("stats", "--ssd-dir", ssd, "--json")  # the counters outlive the server
    (only,) = doc["models"]
    path, fingerprint = only["model"].split("@")
    assert path.endswith("/model") and fingerprint.startswith("fp:") and only["num_blocks"] > 0
    assert only["counters"]["num_fetches"] == 2 and only["counters"]["cached_tokens"] == cached
    assert doc["other_pids"] == []


def test_readable_sizes_ages_and_durations():
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 GiB",
    ]
    assert [format_age(s) for s in (59, 3600, 93784, 8 * 86400)] == ["59s", "1h", "1d 2h", "1w 1d"]
    assert [parse_duration(t) for t in ("7d", "12h", "1h30m", "90")] == [604800, 43200, 5400, 90]
    for bad in ("", "7x", "-1", "d7", "inf"):
        with pytest.raises(ValueError):
            parse_duration(bad)
