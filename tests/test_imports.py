"""The module graph, read from the code: layers bottom up by folder, no import cycles, and the
library never imports an engine's framework.

Every import counts: those inside functions, and those a package's ``__init__`` makes. Importing
``pflalign.data.node`` runs ``pflalign/__init__.py`` and ``pflalign/data/__init__.py`` first, so
a module that imports it depends on both package faces too. A module's layer is the layer of the
folder it stands in (:data:`FOLDER_LAYERS`, the architecture of docs/design.md); a new module
takes its folder's layer, and a new folder must be given one here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("pflalign", "clients", "strategies")

#: each folder's layer, bottom up: a module imports only from its own layer or below
FOLDER_LAYERS = {
    "pflalign": 0,  # the package face, which imports nothing
    "pflalign/process": 1, "pflalign/settings": 1, "pflalign/wire": 1,
    "pflalign/data": 2, "pflalign/models": 2, "pflalign/outputs": 2,
    "pflalign/training": 3, "pflalign/training/optim": 3, "pflalign/server": 3,
    "pflalign/optim": 3,  # deprecated: the optimizers' old place, an alias for one release
    "pflalign/methods": 4,
    "pflalign/engines": 5,
    "pflalign/round": 6, "pflalign/round/features": 6,  # the round: loop, schedulers, features
    "pflalign/run": 7,  # the experiment around it: CLI, driver, studies, docs
    "clients": 8, "strategies": 8,  # the apps
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_of(path: Path, root: Path) -> str:
    return path.parent.relative_to(root).as_posix()


def imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module ``module``'s code imports, anywhere in it (functions included), relative
    imports resolved; ``from a import b`` names both ``a`` and ``a.b``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def with_package_faces(name: str) -> set[str]:
    """``name`` and every package above it, whose ``__init__`` importing ``name`` runs."""
    parts = name.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts) + 1)}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES,
                 ) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Project module -> the project modules its import statements load (package faces
    included), and each module's folder."""
    files = [p for package in packages for p in (root / package).rglob("*.py")]
    modules = {module_name(p, root): p for p in files}
    graph, folders = {}, {}
    for name, path in modules.items():
        loaded = set()
        for target in imported(ast.parse(path.read_text()), name, path.stem == "__init__"):
            loaded |= with_package_faces(target)
        own_faces = with_package_faces(name) - {name}  # loaded before the module itself runs
        graph[name] = {m for m in loaded if m in modules and m != name and m not in own_faces}
        folders[name] = folder_of(path, root)
    return graph, folders


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


#: the imports up a layer that the architecture names: the Flower engine, registered by its
#: module in the app layer, which the driver imports (in a function) only when a run uses it
ALLOWED_UPWARD = {("pflalign.run.driver", "strategies"),
                  ("pflalign.run.driver", "strategies.simulation")}


def upward_imports(graph: dict[str, set[str]], folders: dict[str, str],
                   layers: dict[str, int]) -> list[str]:
    """Every import from a module to one in a higher layer, as 'a (folder, layer) imports b
    (folder, layer)'."""
    def where(m: str) -> str:
        return f"{folders[m]}, layer {layers[folders[m]]}"

    return sorted(f"{m} ({where(m)}) imports {d} ({where(d)})" for m, deps in graph.items()
                  for d in deps if layers[folders[d]] > layers[folders[m]])


def problems(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES,
             layers: dict[str, int] = FOLDER_LAYERS) -> list[str]:
    """What is wrong with the module graph under ``root``: folders without a layer, an import
    cycle (its path), imports up a layer."""
    graph, folders = import_graph(root, packages)
    # the named deferred imports run inside a function, after every module involved has loaded:
    # they take part in no import-time cycle
    graph = {m: {d for d in deps if (m, d) not in ALLOWED_UPWARD} for m, deps in graph.items()}
    unplaced = sorted({f for f in folders.values() if f not in layers})
    if unplaced:
        return [f"folder {f} has no layer in FOLDER_LAYERS" for f in unplaced]
    cycle = find_cycle(graph)
    found = [f"import cycle: {' -> '.join(cycle)}"] if cycle else []
    return found + upward_imports(graph, folders, layers)


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


PLANTED_LAYERS = {"lib": 0, "lib/low": 1, "lib/high": 2}


def test_the_checker_finds_a_cycle_through_a_package_face(tmp_path):
    """``lib.low.a`` imports ``lib.high.b`` only inside a function; importing ``lib.high.b``
    runs ``lib/high/__init__.py``, which imports ``lib.high.c``, which imports ``lib.low.a``."""
    _plant(tmp_path, {"lib/__init__.py": "", "lib/low/__init__.py": "",
                      "lib/low/a.py": "def f():\n    from lib.high import b\n",
                      "lib/high/__init__.py": "from lib.high import c\n",
                      "lib/high/b.py": "", "lib/high/c.py": "import lib.low.a\n"})
    found = problems(tmp_path, ("lib",), PLANTED_LAYERS)
    assert found[0] == "import cycle: lib.high -> lib.high.c -> lib.low.a -> lib.high"
    assert "lib.low.a (lib/low, layer 1) imports lib.high (lib/high, layer 2)" in found
    assert "lib.low.a (lib/low, layer 1) imports lib.high.b (lib/high, layer 2)" in found


def test_the_checker_finds_an_upward_import_and_an_unplaced_folder(tmp_path):
    _plant(tmp_path, {"lib/__init__.py": "", "lib/low/__init__.py": "",
                      "lib/low/a.py": "from ..high.b import thing\n",
                      "lib/high/__init__.py": "", "lib/high/b.py": "thing = 1\n"})
    assert problems(tmp_path, ("lib",), PLANTED_LAYERS) == [
        "lib.low.a (lib/low, layer 1) imports lib.high (lib/high, layer 2)",
        "lib.low.a (lib/low, layer 1) imports lib.high.b (lib/high, layer 2)"]
    _plant(tmp_path, {"lib/new/__init__.py": ""})
    assert problems(tmp_path, ("lib",), PLANTED_LAYERS) == [
        "folder lib/new has no layer in FOLDER_LAYERS"]
    (tmp_path / "lib/new/__init__.py").unlink()
    (tmp_path / "lib/new").rmdir()
    _plant(tmp_path, {"lib/low/a.py": "import lib.low\n"})  # its own package: no edge
    assert problems(tmp_path, ("lib",), PLANTED_LAYERS) == []


def test_the_project_has_no_cycle_and_no_import_up_a_layer():
    graph, _ = import_graph()
    assert {"pflalign.run.config", "pflalign.methods.registry", "clients.app"} <= set(graph)
    assert problems() == []


def test_no_module_guards_an_import():
    guarded = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
               if "TYPE_CHECKING" in p.read_text()]
    assert guarded == []


def test_package_faces_define_nothing():
    """A package's ``__init__`` in the library is its docstring, or gathers its own modules'
    public names (``pflalign.training.optim``, as ``torch.optim`` does): importing one module of
    a package loads nothing of another."""
    faces = list((ROOT / "pflalign").rglob("__init__.py"))
    assert len(faces) >= 12
    for face in faces:
        package = module_name(face, ROOT)
        body = ast.parse(face.read_text()).body
        code = [node for node in body if not (isinstance(node, ast.Expr)
                                              and isinstance(node.value, ast.Constant))]
        if face == ROOT / "pflalign" / "__init__.py":  # the public face: names loaded lazily
            assert [ast.unparse(node) for node in code if isinstance(
                node, ast.Import | ast.ImportFrom)] == ["from importlib import import_module"]
            continue
        if face == ROOT / "pflalign" / "optim" / "__init__.py":  # deprecated alias
            continue
        for node in code:
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").startswith(f"{package}."), (face, node.module)
            else:  # the list of names it gathers
                assert isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == \
                    "__all__", (face, ast.unparse(node))


def test_the_library_imports_neither_flwr_nor_ray():
    code = ("import sys, pflalign.run.config, pflalign.run.driver, pflalign.run.docs, "
            "pflalign.engines.sequential, pflalign.engines.batched, pflalign.engines.workers, "
            "pflalign.training.vectorised, pflalign.engines.store; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_a_client_process_does_not_load_the_round_loop():
    """The Flower ClientApp's imports stop at the engines' client-side handler: no driver,
    round loop, audit or study in a client process."""
    code = ("import sys, clients.app; "
            "print(sorted(m for m in sys.modules if m.startswith(('pflalign.run.', "
            "'strategies'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "['pflalign.run.config']"


def test_the_public_face_loads_each_name_from_its_module_and_nothing_eagerly():
    """``from pflalign import PFLAlign, GENIE, build_model, ...``: each public name is the
    library's own object, loaded when first used (importing pflalign loads neither torch nor
    flwr); the old place of the optimizers still works, with a DeprecationWarning."""
    import pflalign
    from pflalign.models.registry import build_model
    from pflalign.training.optim import GENIE, PFLAlign

    assert pflalign.PFLAlign is PFLAlign and pflalign.GENIE is GENIE
    assert pflalign.build_model is build_model
    for name in pflalign.__all__:
        assert getattr(pflalign, name) is not None, name
        module = pflalign._PUBLIC[name]
        assert module.startswith("pflalign."), (name, module)  # never flwr's side
    code = ("import sys, pflalign; assert 'torch' not in sys.modules; "
            "from pflalign import PFLAlign; assert 'torch' in sys.modules; "
            "assert not any(m == 'flwr' or m.startswith('flwr.') for m in sys.modules); "
            "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import pflalign.optim\nexcept DeprecationWarning as w:\n    print(w)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.startswith("pflalign.optim is deprecated: import the optimizers from pflalign")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pflalign.Nope  # noqa: B018


def test_method_files_read_typed_settings_only():
    """A method reads its settings through their typed views (``settings.run.dp``, its Params),
    never by a key string: a renamed or moved key then fails where it is read, not silently."""
    reads = re.compile(r"""\b(settings|values|merged)\s*(\[\s*["']|\.get\(\s*["'])""")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "pflalign" / "methods").glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if reads.search(line)]
    assert found == []
    assert reads.search('        if settings["pflalign-state"] == "server":')  # the pattern bites
    assert reads.search("    model = overrides.get('model', settings.get('model'))")


def test_the_named_deferred_imports_are_the_only_ones_and_stay_inside_a_function():
    """The driver's import of the Flower engine is in the code (the graph sees it), inside a
    function (a run of another engine never loads it), and it is the only import up a layer."""
    graph, _ = import_graph()
    assert {(m, d) for m, deps in graph.items() for d in deps} >= ALLOWED_UPWARD
    tree = ast.parse((ROOT / "pflalign" / "run" / "driver.py").read_text())
    top = {ast.unparse(node) for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)}
    assert not any("strategies" in line for line in top)
