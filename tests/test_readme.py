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
