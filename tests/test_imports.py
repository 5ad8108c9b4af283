"""The module graph: layers bottom up, no import cycles (guarded imports included), and the
library never imports an engine's framework."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import ROOT

PACKAGES = ("pflalign", "clients", "strategies")


def _module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> set[str]:
    """Every module imported anywhere (functions and ``if TYPE_CHECKING:`` blocks included: an
    import for type hints only is still a dependency of the module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports."""
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        imported = _imports(ast.parse(path.read_text()))
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_the_project():
    graph = import_graph()
    assert "pflalign.config" in graph and "pflalign.methods" in graph
    assert find_cycle(graph) is None


#: the layers, bottom up (docs/design.md): a module imports only from its own layer or below
LAYERS = {
    1: {"pflalign", "pflalign.options", "pflalign.params", "pflalign.protocol",
        "pflalign.messages", "pflalign.settings", "pflalign.state", "pflalign.caches"},
    2: {"pflalign.data", "pflalign.shakespeare", "pflalign.language", "pflalign.partition",
        "pflalign.federation", "pflalign.models", "pflalign.node", "pflalign.train",
        "pflalign.optim", "pflalign.optim.common",
        "pflalign.optim.genie", "pflalign.optim.pflalign", "pflalign.local", "pflalign.client",
        "pflalign.vectorised", "pflalign.server", "pflalign.aggregation", "pflalign.baselines",
        "pflalign.sampling", "pflalign.metrics", "pflalign.gga", "pflalign.store",
        "pflalign.interrupt", "pflalign.checkpoint"},
    3: {"pflalign.method"},
    4: {"pflalign.methods"} | {f"pflalign.methods.{p.stem}"
                               for p in (ROOT / "pflalign" / "methods").glob("*.py")
                               if p.stem != "__init__"},
}


def layer_of(module: str) -> int:
    return next((n for n, members in LAYERS.items() if module in members), 5)


def test_imports_go_down_the_layers():
    graph = import_graph()
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                    for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert upward == []
    assert all(layer_of(m) == 5 for m in graph if m.startswith(("clients", "strategies")))
    # nothing below the top imports the config parser, and no module guards an import
    assert not [m for m, deps in graph.items() if "pflalign.config" in deps and layer_of(m) < 5]
    guarded = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
               if "TYPE_CHECKING" in p.read_text()]
    assert guarded == []


def test_the_library_imports_neither_flwr_nor_ray():
    code = ("import sys, pflalign.config, pflalign.engines.sequential, pflalign.docs, "
            "pflalign.engines.batched, pflalign.vectorised, pflalign.store; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
