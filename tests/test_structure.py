"""The package's shape rules, checked from its source: no import cycle, small modules
and functions (STYLE: one concept per module).

The size rule lives here and only here (the Makefile's lint runs this file): a
module of prefixcache/ or tools/ aims at 300 lines; one past it is a whole
concept kept together and is listed by name with the reason, and fails at 600;
a listed module brought back under the target must leave the list. The cycle
check counts imports made for type checking too: a room below never names one
above, not even for a type."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import structure

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prefixcache"
TARGET_MODULE_LINES = 300
MAX_MODULE_LINES = 600  # a listed module's bound
MAX_FUNCTION_LINES = 50  # the package's functions
# modules over TARGET_MODULE_LINES: each a whole concept, with the reason it stays whole
OVER_TARGET: dict[str, str] = {
    "prefixcache/cache/prefix_cache.py": "the facade: every public verb of PrefixCache in "
    "one class, each a few lines handing the work down",
    "prefixcache/tiers/ssd/index.py": "the SSD tier's LMDB index: each verb one short "
    "transaction over its named databases (entries, space, pinning, shares, runfiles "
    "do the work)",
    "prefixcache/tiers/ssd/tier.py": "the SSD tier: every hook of the tier contract over one "
    "index, one writer and one payload directory",
    "prefixcache/tiers/hot/tier.py": "the hot tier: every hook of the tier contract over one "
    "LRU and its children map, with the eviction policy's and the tenant shares' hooks",
    "prefixcache/config.py": "every setting in one frozen dataclass: each field's default, "
    "meaning and rule in one place, read as flags and PREFIXCACHE_* variables",
}


def modules() -> dict[str, Path]:
    """The package's modules by dotted name."""
    return structure.modules(PACKAGE)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def graph_of(mods: dict[str, Path]) -> dict[str, set[str]]:
    known = set(mods)
    # a package's __init__ is imported with any of its submodules: not an edge back
    return {
        name: {t for t in structure.imports(name, path, known) if not name.startswith(t + ".")}
        for name, path in mods.items()
    }


def test_no_import_cycle():
    assert find_cycle(graph_of(modules())) is None


def test_the_cycle_check_finds_a_cycle():
    """Negative control: a graph with a cycle is caught."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def sizes() -> dict[str, int]:
    """Lines of every module of prefixcache/ and tools/, by path from the root."""
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "tools").rglob("*.py")]
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted(paths)}


def over(found: dict[str, int], limit: int) -> set[str]:
    return {path for path, lines in found.items() if lines > limit}


def test_no_module_fails_the_size_rule():
    assert over(sizes(), MAX_MODULE_LINES) == set()


def test_modules_over_the_target_are_the_listed_ones():
    assert over(sizes(), TARGET_MODULE_LINES) == set(OVER_TARGET)
    assert all(len(reason.split()) >= 5 for reason in OVER_TARGET.values())


def test_the_size_checks_catch_a_long_module():
    """Negative control: a module past either bound is caught."""
    found = {"a.py": 120, "b.py": 301, "c.py": 601}
    assert over(found, TARGET_MODULE_LINES) == {"b.py", "c.py"}
    assert over(found, MAX_MODULE_LINES) == {"c.py"}


@pytest.mark.parametrize("name", sorted(modules()))
def test_function_sizes(name):
    path = modules()[name]
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name} has {size}"


HIDDEN_CONTRACTS = (
    r"type\([^)]*\)\.\w+ is ",  # an identity test of a method: "does it override?"
    r"(hasattr|getattr)\((tier|codec|builder|reader|self\.tier)\b",  # probing for a hook
)


def hidden_contracts(source: str) -> list[str]:
    return [m.group(0) for p in HIDDEN_CONTRACTS for m in re.finditer(p, source)]


def test_hooks_are_declared_not_probed():
    """Optional hooks are declared on their base class with a default (tiers/base.py,
    codecs/base.py): nothing asks whether a method is overridden or an attribute
    exists."""
    found = {n: hidden_contracts(p.read_text()) for n, p in modules().items()}
    assert {n: f for n, f in found.items() if f} == {}


def test_the_hook_check_finds_a_probe():
    """Negative control."""
    assert hidden_contracts("if type(codec).covers is Codec.covers:") != []
    assert hidden_contracts("if hasattr(tier, 'children'):") != []
    assert hidden_contracts("if isinstance(tier, ListsChildren):") == []


ADMIN = "prefixcache.tiers.ssd.admin"


def serving_importers_of_admin(graph: dict[str, set[str]]) -> set[str]:
    """Modules outside the commands (cli) and the admin corner that import it."""
    return {
        name
        for name, deps in graph.items()
        if not name.startswith(("prefixcache.cli", ADMIN))
        and any(d == ADMIN or d.startswith(ADMIN + ".") for d in deps)
    }


def test_the_serving_path_never_imports_the_ssd_admin_corner():
    assert serving_importers_of_admin(graph_of(modules())) == set()


def test_the_admin_check_finds_an_importer():
    """Negative control."""
    graph = {"prefixcache.cache.prefix_cache": {ADMIN + ".view"}, "prefixcache.cli.show": {ADMIN}}
    assert serving_importers_of_admin(graph) == {"prefixcache.cache.prefix_cache"}


def test_the_cycle_check_counts_type_checking_imports(tmp_path):
    """Negative control: a circle closed only by a TYPE_CHECKING import is a circle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 1\n"
    )
    assert find_cycle(graph_of(structure.modules(package))) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_tier_contract_is_narrow():
    """What every tier must answer stays small; what some tiers do is a capability
    (tiers/base.py), each implemented by a tier of the package."""
    from prefixcache.tiers import base
    from prefixcache.tiers.hot.tier import HotTier
    from prefixcache.tiers.remote.tier import RemoteTier
    from prefixcache.tiers.ssd.tier import SsdTier

    core = {n for n, v in vars(base.Tier).items() if callable(v) and not n.startswith("_")}
    assert core == {
        *("entry", "held", "contains", "reader", "put", "remove"),
        *("touch", "flush", "close", "payload_names", "stats"),
    }
    capabilities = [base.ListsChildren, base.KeepsPins, base.Persistent, base.Metered]
    capabilities += [base.ReportsEvents, base.CostGated]
    tiers = (HotTier, SsdTier, RemoteTier)
    assert [c.__name__ for c in capabilities if not any(issubclass(t, c) for t in tiers)] == []
