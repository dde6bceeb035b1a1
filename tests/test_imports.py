"""The library imports downward only, and no module grows past a size one reads in a sitting.

The import graph is read from the source with `ast`, not by importing: every `import` counts as an arrow, at module
level, inside a function, or under `if TYPE_CHECKING:`, because an arrow that only the type checker follows still ties
the two modules together. An import of a package is an arrow to its `__init__`; `from . import x` is an arrow to
submodule `x` when there is one.
"""

import ast
from pathlib import Path

PACKAGE = "zjax"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports, anywhere in its source."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    arrows: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            arrows.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from . import x` / `from .pkg import mod`: an arrow to the submodule when x is one, else to the package
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                arrows.add(submodule if submodule in modules else source)
    resolved = set()
    for target in arrows:
        # `import zjax.a.b` also names zjax.a and zjax; the arrow that matters is to the deepest module that exists
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            resolved.add(target)
    return resolved


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, and modules that import themselves (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _loop(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path of imports from ``start`` back to itself, inside one strongly connected component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    return [start]


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    arrows = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    loop = " -> ".join(_loop(component[0], members, graph))
    return "\n".join([f"  cycle of {len(component)}: {loop}", "  every arrow among them:", *arrows])


def test_graph_sees_the_package():
    graph = _graph()
    assert "zjax" in graph and "zjax.core" in graph
    # a relative import and a package import both resolve
    assert "zjax.core" in graph["zjax"]
    assert any(target.startswith("zjax.core.") for target in graph["zjax.core"])


def test_cycle_detection_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"], ["d"]]
    assert _loop("a", {"a", "b", "c"}, graph) == ["a", "b", "c", "a"]


def test_every_kind_of_import_is_an_arrow(tmp_path):
    """Module level, inside a function, under TYPE_CHECKING; relative and absolute; packages and submodules."""
    source = tmp_path / "_mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from . import _a\n"
        "from ..sharding import _mesh\n"
        "if TYPE_CHECKING:\n"
        "    from ._b import B\n"
        "def f():\n"
        "    import zjax.stages._stage\n"
        "    from zjax import offload\n"
        "    from .. import pipeline\n"
    )
    names = ["zjax", "zjax.core._a", "zjax.core._b", "zjax.sharding", "zjax.sharding._mesh", "zjax.stages._stage"]
    modules = {name: source for name in [*names, "zjax.offload", "zjax.pipeline"]}
    assert _imports("zjax.core._mod", source, modules) == {
        "zjax.core._a",
        "zjax.core._b",
        "zjax.sharding._mesh",
        "zjax.stages._stage",
        "zjax.offload",
        "zjax.pipeline",
    }


def test_no_import_cycles():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "modules of zjax import each other in a circle:\n" + "\n".join(
        _describe(component, graph) for component in cycles
    )


def test_no_module_over_the_line_limit():
    counts = {path: len(path.read_text().splitlines()) for path in _modules().values()}
    offenders = sorted(((n, p) for p, n in counts.items() if n > MAX_LINES), reverse=True)
    assert not offenders, f"modules over {MAX_LINES} lines (split them by concept):\n" + "\n".join(
        f"  {n:5d} {p.relative_to(ROOT.parent)}" for n, p in offenders
    )
