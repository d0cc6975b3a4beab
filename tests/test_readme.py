"""The README stays true to the package: its Architecture map names every module,
and every doc it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prefixcache"


def architecture_map(text: str) -> str:
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def unnamed(text: str, package: Path = PACKAGE) -> list[str]:
    """Modules and subpackages the map does not name (``__init__``/``__main__`` aside)."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", architecture_map(text)))
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.stem in {"__init__", "__main__"}:
            continue
        if path.stem not in words:
            missing.append(str(path.relative_to(package)))
    for path in sorted(p for p in package.rglob("*") if (p / "__init__.py").exists()):
        if path != package and path.name not in words:
            missing.append(f"{path.relative_to(package)}/")
    return missing


def test_the_architecture_map_names_every_module():
    assert unnamed((ROOT / "README.md").read_text()) == []


def test_a_module_left_out_of_the_map_is_caught():
    text = (ROOT / "README.md").read_text()
    assert unnamed(text.replace("costs", "")) == ["cache/costs.py"]


def test_linked_docs_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links its docs"
    assert [link for link in links if not (ROOT / link).exists()] == []


# A README benchmark row states one claim: its headline figure with its range in at most
# this many words (the full table is in docs/benchmarks.md), and a command of tools/.
RESULT_WORDS = 25
TOOLS = ROOT / "tools"
# where a tool's options may be declared besides the tool itself
SHARED_ARGS = [TOOLS / "benchlib.py", *TOOLS.glob("reuselib/*.py"), *TOOLS.glob("soaklib/*.py")]


def benchmark_rows(text: str) -> list[list[str]]:
    """The README's benchmark table: one [claim, result, command] per row."""
    section = text.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # no header
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def row_faults(row: list[str]) -> list[str]:
    """What is wrong with one benchmark row: a result over the bound, a command that names
    no tool, a tool that is not in tools/, an option the tool does not declare."""
    if len(row) != 3:
        return [f"{len(row)} cells, not 3: {row}"]
    claim, result, command = row
    faults = []
    if len(result.split()) > RESULT_WORDS:
        faults.append(f"{claim!r}: result of {len(result.split())} words > {RESULT_WORDS}")
    commands = re.findall(r"`python (tools/[\w/]+\.py)([^`]*)`", command)
    if not commands:
        faults.append(f"{claim!r}: no `python tools/....py` command")
    for path, options in commands:
        if not (ROOT / path).is_file():
            faults.append(f"{claim!r}: {path} does not exist")
            continue
        sources = [(ROOT / path).read_text(), *(p.read_text() for p in SHARED_ARGS)]
        for option in re.findall(r"(--[\w-]+)", options):
            if not any(f'"{option}"' in source for source in sources):
                faults.append(f"{claim!r}: {path} has no option {option}")
    return faults


def test_benchmark_rows_are_short_and_name_real_commands():
    rows = benchmark_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 10, "the README's benchmark table was not found"
    assert [fault for row in rows for fault in row_faults(row)] == []


def test_a_long_row_or_a_missing_command_is_caught():
    long = ["claim", " ".join(["word"] * (RESULT_WORDS + 1)), "`python tools/bench_serve.py`"]
    assert row_faults(long) == [f"'claim': result of {RESULT_WORDS + 1} words > {RESULT_WORDS}"]
    gone = ["claim", "1.0x", "`python tools/bench_gone.py`"]
    assert row_faults(gone) == ["'claim': tools/bench_gone.py does not exist"]
    option = ["claim", "1.0x", "`python tools/bench_serve.py --lockstep --no-such`"]
    assert row_faults(option) == ["'claim': tools/bench_serve.py has no option --no-such"]
    assert row_faults(["claim", "1.0x", "make bench"]) == [
        "'claim': no `python tools/....py` command"
    ]
