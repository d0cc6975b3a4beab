"""The package's structure in figures: rooms, floors, arrows, arrows back up, circles.

A room is a top-level module of ``prefixcache/`` or one of its folders
(``--depth 2`` looks one level deeper, e.g. ``tiers.hot``); an arrow is an
import from one room into another, lazy and ``TYPE_CHECKING`` imports included.
Floors are the levels of the graph of rooms once each circle (a strongly
connected set of rooms) is folded into one; an arrow back up is an arrow inside
a circle. Also counts top-level modules and mixins (a base class of the package
with no ``__init__`` that declares attributes its host sets). Reads the source
only; imports nothing.

    python tools/structure.py [--depth 1] [--root prefixcache] [--arrows]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (TYPE_CHECKING included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def room(name: str, depth: int) -> str:
    return ".".join(name.split(".")[1 : 1 + depth]) or "__init__"


def room_graph(package: Path, depth: int) -> dict[str, set[str]]:
    mods = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        mine = room(name, depth)
        graph.setdefault(mine, set())
        for dep in imports(name, path, set(mods)):
            if name.startswith(dep + "."):
                continue  # a package's own __init__
            theirs = room(dep, depth)
            if theirs != mine and not mine.startswith(theirs + "."):
                graph[mine].add(theirs)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected sets of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floors(graph: dict[str, set[str]], parts: list[set[str]]) -> int:
    """Levels of the graph with each circle folded into one room."""
    rep = {v: min(p) for p in parts for v in p}
    folded: dict[str, set[str]] = {}
    for v, deps in graph.items():
        folded.setdefault(rep.get(v, v), set()).update(rep.get(d, d) for d in deps)
    for v in folded:
        folded[v].discard(v)
    level: dict[str, int] = {}

    def height(v: str) -> int:
        if v not in level:
            level[v] = 0
            level[v] = 1 + max((height(d) for d in folded[v]), default=0)
        return level[v]

    return max((height(v) for v in folded), default=0)


def mixins(package: Path) -> list[str]:
    """Classes that take part of their body from a mixin of the package: a base class
    with no ``__init__`` of its own that declares, as bare annotations, attributes
    its host sets (the contracts, ABCs and Protocols, aside)."""
    classes: dict[str, ast.ClassDef] = {}
    trees = {p: ast.parse(p.read_text()) for p in package.rglob("*.py")}
    for tree in trees.values():
        classes |= {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def is_mixin(name: str) -> bool:
        node = classes.get(name)
        if node is None or node.decorator_list:
            return False
        bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
        body = node.body
        declared = any(isinstance(n, ast.AnnAssign) and n.value is None for n in body)
        has_init = any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in body)
        return declared and not has_init and not bases & {"ABC", "Protocol", "TypedDict"}

    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = [ast.unparse(b) for b in node.bases if is_mixin(ast.unparse(b))]
                if own:
                    out.append(f"{path.relative_to(package.parent)}:{node.name}({', '.join(own)})")
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", default=str(Path(__file__).resolve().parent.parent / "prefixcache")
    )
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--arrows", action="store_true", help="list every arrow")
    args = parser.parse_args()
    package = Path(args.root)
    graph = room_graph(package, args.depth)
    parts = circles(graph)
    back = sum(1 for p in parts for v in p for d in graph[v] if d in p)
    top = [p for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    print(
        f"rooms {len(graph)}  floors {floors(graph, parts)}  "
        f"arrows {sum(len(d) for d in graph.values())}  arrows in circles {back}  "
        f"circles {len(parts)}"
    )
    found = mixins(package)
    print(f"top-level modules {len(top)}  modules {len(modules(package))}  mixins {len(found)}")
    for part in parts:
        print("circle:", " <-> ".join(sorted(part)))
    for mixin in found:
        print("mixin:", mixin)
    if args.arrows:
        for v in sorted(graph):
            print(f"{v} -> {', '.join(sorted(graph[v]))}")


if __name__ == "__main__":
    main()
