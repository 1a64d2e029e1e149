"""The layers of docs/design.md §4, enforced: no module imports from a layer above its own, and
every module of the package has a layer (import-linter's contracts in pyproject.toml). Every
third-party package the package imports is declared in its metadata (deptry, pyproject.toml)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import REPO
from importlinter.cli import lint_imports


def test_import_layers_are_kept():
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exit_code = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True)
    assert exit_code == 0, output.getvalue()[-3000:]


def _design_layers() -> list[set[str]]:
    """The layers that docs/design.md §4's table draws, top first: per layer, the folders and
    top-level modules its rows name in their second column (a row without a layer name continues
    the layer above)."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("### Layers", 1)[1].split("###", 1)[0]
    layers: list[set[str]] = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] == "layer" or (cells[0] and set(cells[0]) <= {"-"}):
            continue
        # the folder or module names: `name/` or `name`, before any parenthesis
        names = {name.rstrip("/") for name in re.findall(r"`([a-z_]+/?)`", cells[1].split("(")[0])}
        if cells[0]:
            layers.append(set())
        layers[-1] |= names
    return layers


def test_design_draws_the_layers_that_import_linter_enforces():
    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layered,) = [c for c in contract["contracts"] if c["type"] == "layers"]
    enforced = [{name.strip() for name in layer.split("|")} for layer in layered["layers"]]
    assert _design_layers() == enforced


def _imports_through_faces(source: Path) -> dict[str, set[str]]:
    """module → the modules of the package under ``source`` (``src/``) it imports, where ``from
    P import name`` imports the package P itself (its ``__init__``, the package's face) and, when
    ``name`` is a submodule, that submodule too; ``from P.module import name`` imports P.module."""
    modules = {}
    for path in (source / "gatherlab").rglob("*.py"):
        parts = path.relative_to(source).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[module] = {name for name in imported if name in modules and name != module}
    return graph


def _cycles_through_faces(source: Path) -> list[list[str]]:
    """Every import cycle that passes through a package's ``__init__``: a module that imports from
    package P's face while P's ``__init__`` imports, directly or not, that module."""
    graph = _imports_through_faces(source)
    packages = {module for module in graph if (source / module.replace(".", "/")).is_dir()}
    cycles = []
    for module, imported in sorted(graph.items()):
        for package in sorted(imported & packages):
            path, seen = [package], {package: None}
            while path and path[-1] != module:  # depth-first: a path from the face to the module
                nxt = next((m for m in sorted(graph[path[-1]]) if m not in seen), None)
                if nxt is None:
                    path.pop()
                else:
                    seen[nxt] = None
                    path.append(nxt)
            if path:
                cycles.append([module, *path])
    return cycles


def test_no_import_cycle_passes_through_a_package_s_face():
    """A module of a package takes what it needs from the module that defines it, never through
    a package's ``__init__`` that imports the module back: that import works only as long as the
    names arrive in the right order."""
    assert _cycles_through_faces(REPO / "src") == []


def _cycles_inside_folders(source: Path) -> list[list[str]]:
    """Every import cycle among the modules of one folder of the package under ``source``, an
    import inside a function included (it runs later, but the two modules still each need the
    other): each cycle's modules, sorted (the strongly connected components of the folder's
    import graph, Tarjan's algorithm). A package's ``__init__`` is left out: the cycles through it
    are ``_cycles_through_faces``'."""
    graph = _imports_through_faces(source)
    packages = {module for module in graph if (source / module.replace(".", "/")).is_dir()}

    def folder(module: str) -> str:
        return module.rpartition(".")[0]

    edges = {
        module: {m for m in imported - packages if folder(m) == folder(module)}
        for module, imported in graph.items()
        if module not in packages
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(edges[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_cycle_inside_a_folder():
    """docs/design.md §4: inside a folder, modules import each other freely, without cycles (a
    fact two modules need belongs below both: ``lab.jobs`` and ``lab.preflight`` both read
    ``core.runfiles.refuse_finished``)."""
    assert _cycles_inside_folders(REPO / "src") == []


def test_an_import_cycle_inside_a_folder_is_found(tmp_path):
    folder = tmp_path / "gatherlab" / "lab"
    folder.mkdir(parents=True)
    (tmp_path / "gatherlab" / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    (folder / "first.py").write_text("from gatherlab.lab import second\n")
    (folder / "second.py").write_text("def late():\n    from gatherlab.lab.first import x\n")
    (folder / "third.py").write_text("from gatherlab.lab import first\n")
    assert _cycles_inside_folders(tmp_path) == [["gatherlab.lab.first", "gatherlab.lab.second"]]


def _deptry(project: Path) -> subprocess.CompletedProcess:
    """deptry with the project's configuration, run on the package's code as ``make lint`` runs
    it: a fresh interpreter, since deptry's interface is its command line (its exit status, what it
    prints), not a Python API."""
    return subprocess.run(
        [sys.executable, "-m", "deptry", "--no-ansi", "src"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_import_of_the_package_is_declared_in_its_metadata():
    result = _deptry(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_undeclared_import_fails_the_dependency_check(tmp_path):
    # The same configuration on a copy whose code imports what the metadata does not declare for
    # users: psutil is only a test dependency (the dev extra), PyYAML only comes with Hydra.
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "src" / "gatherlab" / "lab" / "tracking.py").open("a") as module:
        module.write("\nimport psutil\nimport yaml\n")
    result = _deptry(tmp_path)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "DEP004 'psutil' imported but declared as a dev dependency" in output
    assert "DEP003 'yaml' imported but it is a transitive dependency" in output
