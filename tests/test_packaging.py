"""The package as a user installs it: ``pip install .`` into a fresh venv, then its script.

The working tree is copied (no venv, no build output) and installed by this
environment's pip into a new venv, first plain (on Linux: mlx without a
backend, and never redis), then with the backend extra the README names
(``[cpu]`` on Linux). Checked there: the console script's ``--version`` and
``--help``, the metadata (SPDX license, license file, extras), and that the
package works without redis while the remote tier names the extra it needs.
This takes a minute (the dependencies are installed; pip's cache helps).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache
from prefixcache.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".venv*",
    ".git",
    "build",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "demo-cache",
)
LINUX = sys.platform.startswith("linux")
OUTSIDE = Path("/")
NO_REDIS_PROBE = """
import importlib.util
from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import MissingExtraError
from prefixcache.tiny.models import build_model
assert importlib.util.find_spec("redis") is None
model = build_model("llama")
with PrefixCache(model, CacheConfig(block_size=16, hot_cache_only=True), model_id="m") as pc:
    assert pc.match(list(range(40))) == 0  # the package works without redis
try:
    PrefixCache(model, CacheConfig(hot_cache_only=True, remote_url="redis://127.0.0.1:1"))
except MissingExtraError as err:
    print(err.extra, err)
"""


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command (from ``cwd``: outside the working tree, whose ``prefixcache`` and
    ``*.egg-info`` would shadow the installed ones for ``python -c``)."""
    return subprocess.run(
        list(map(str, args)), capture_output=True, text=True, timeout=900, cwd=cwd or OUTSIDE
    )


def pip_install(venv: Path, target: str) -> None:
    """This environment's pip installs ``target`` into ``venv`` (a venv without pip)."""
    pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python")
    done = run(*pip, "install", "--quiet", target)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> tuple[Path, Path]:
    """(copy of the working tree, a new venv with nothing installed)."""
    root = tmp_path_factory.mktemp("packaging")
    shutil.copytree(ROOT, root / "src", ignore=COPY_IGNORE)
    assert run(sys.executable, "-m", "venv", "--without-pip", root / "venv").returncode == 0
    return root / "src", root / "venv"


def test_pip_install_into_a_fresh_venv_and_run_the_console_script(fresh):
    src, venv = fresh
    script, python = venv / "bin" / "prefixcache", venv / "bin" / "python"
    pip_install(venv, str(src))
    if LINUX:  # plain mlx has no Linux backend: one line naming the extras, exit 2
        done = run(script, "--version")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "pip install 'prefixcache[cpu]'" in done.stderr.strip().splitlines()[-1]
        pip_install(venv, f"{src}[cpu]")
    done = run(script, "--version")
    assert done.returncode == 0, done.stderr
    mlx_version = importlib.metadata.version("mlx")
    assert done.stdout.startswith(f"prefixcache {prefixcache.__version__} (mlx {mlx_version}, ")
    done = run(script, "--help")
    listed = re.findall(r"^    (\S+)", done.stdout, re.MULTILINE)
    assert done.returncode == 0 and listed == list(COMMANDS), done.stdout

    done = run(python, "-I", "-c", NO_REDIS_PROBE)
    assert done.returncode == 0, done.stderr
    extra, message = done.stdout.strip().split(" ", 1)
    assert extra == "remote" and "pip install 'prefixcache[remote]'" in message
    assert "remote_url='redis://127.0.0.1:1'" in message
    done = run(script, "stats", "--remote-url", "redis://127.0.0.1:1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "'prefixcache[remote]'" in lines[0]
    # the control: with redis installed (this environment) the same command gets to the server
    here = run(
        sys.executable,
        "-m",
        "prefixcache",
        "stats",
        "--remote-url",
        "redis://127.0.0.1:1",
        cwd=ROOT,
    )
    assert here.returncode == 2 and "remote server redis://127.0.0.1:1" in here.stderr


def test_the_installed_metadata(fresh):
    src, venv = fresh
    if not (venv / "bin" / "prefixcache").exists():
        pip_install(venv, f"{src}[cpu]" if LINUX else str(src))
    probe = (
        "import importlib.metadata as m, json, pathlib, prefixcache\n"
        "d = m.distribution('prefixcache')\n"
        "pkg = pathlib.Path(prefixcache.__file__).parent\n"
        "print(json.dumps({'license': d.metadata['License-Expression'],\n"
        "  'license_files': d.metadata.get_all('License-File'),\n"
        "  'extras': d.metadata.get_all('Provides-Extra'),\n"
        "  'requires': d.metadata.get_all('Requires-Dist'),\n"
        "  'classifiers': d.metadata.get_all('Classifier'),\n"
        "  'files': sorted(str(f) for f in d.files),\n"
        "  'typed': (pkg / 'py.typed').exists(),\n"
        "  'corpus': (pkg / 'tiny/data/corpus.txt').exists()}))\n"
    )
    done = run(venv / "bin" / "python", "-I", "-c", probe)
    assert done.returncode == 0, done.stderr
    meta = json.loads(done.stdout)
    assert meta["license"] == "MIT" and meta["license_files"] == ["LICENSE"]
    assert any(f.endswith("licenses/LICENSE") for f in meta["files"])
    assert {"cpu", "cuda", "metal", "remote", "dev"} <= set(meta["extras"])
    base = [r for r in meta["requires"] if "extra ==" not in r]
    assert any(r.startswith("mlx<") or r.startswith("mlx>") for r in base)  # plain mlx
    assert not any("redis" in r or "mlx[" in r for r in base)
    assert "Typing :: Typed" in meta["classifiers"] and meta["typed"] and meta["corpus"]
    assert not any(f.startswith("tests/") or f.startswith("tools/") for f in meta["files"])
