"""The layers of docs/design.md §4, enforced: no module imports from a layer above its own, and
every module of the package has a layer (import-linter's contracts in pyproject.toml). The floor
plan cannot drift: each folder's docstring names the modules it holds, no other, design §4's table
is what those docstrings make (docs/floorplan.py), and a module's name is used twice only by a
top-level module that holds the public face of its namesake. Every third-party package the package
imports is declared in its metadata (deptry, pyproject.toml)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
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


def _floorplan():
    """docs/floorplan.py, the maker of design §4's table, as a module."""
    spec = importlib.util.spec_from_file_location("docs_floorplan", REPO / "docs" / "floorplan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _design_layers() -> list[set[str]]:
    """The layers that docs/design.md §4's table draws, top first: per layer, the folders its rows
    name in their second column and the top-level modules (``top level``) in their third (a row
    without a layer name continues the layer above, without a folder the folder above)."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("### Layers", 1)[1].split("###", 1)[0]
    layers: list[set[str]] = []
    folder = ""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] == "layer" or (cells[0] and set(cells[0]) <= {"-"}):
            continue
        if cells[0]:
            layers.append(set())
        folder = cells[1] or folder
        name = cells[2] if folder == "top level" else folder
        layers[-1].add(name.strip("`").rstrip("/"))
    return layers


def test_design_draws_the_layers_that_import_linter_enforces():
    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layered,) = [c for c in contract["contracts"] if c["type"] == "layers"]
    enforced = [{name.strip() for name in layer.split("|")} for layer in layered["layers"]]
    assert _design_layers() == enforced


def _floor_plan_drift(source: Path) -> list[str]:
    """Where the docstrings of the package under ``source`` (its folder ``gatherlab``) and its tree
    differ: each folder's ``Modules:`` against its ``.py`` files (``__main__`` included,
    ``__init__`` not), the top level's ``Folders:`` against its packages."""
    floorplan = _floorplan()
    package = source / "gatherlab"
    drift = []
    named, held = floorplan.floor_plan(package), floorplan.modules(package)
    for folder in sorted(held):
        where = f"gatherlab/{folder}/__init__.py".replace("//", "/")
        if unheld := set(named[folder]) - held[folder]:
            drift.append(f"{where} names modules the folder does not hold: {sorted(unheld)}")
        if unnamed := held[folder] - set(named[folder]):
            drift.append(f"{where} does not name the folder's modules {sorted(unnamed)}")
    folders = set(floorplan.listed(package, "Folders"))
    if folders != set(held) - {""}:
        drift.append(f"gatherlab/__init__.py names the folders {sorted(folders)}, the tree holds "
                     f"{sorted(set(held) - {''})}")  # fmt: skip
    return drift


def test_each_folder_s_docstring_names_the_modules_it_holds():
    assert _floor_plan_drift(REPO / "src") == []


def test_design_s_table_of_layers_is_what_the_docstrings_make():
    """docs/design.md §4's table, a row per module, is the floor plan of the docstrings in the
    import-linter's layers (``python docs/floorplan.py`` writes it)."""
    floorplan = _floorplan()
    assert floorplan.committed() == floorplan.table(), "run python docs/floorplan.py"


def test_a_module_missing_from_the_floor_plan_is_found(tmp_path):
    folder = tmp_path / "gatherlab" / "lab"
    folder.mkdir(parents=True)
    (tmp_path / "gatherlab" / "__init__.py").write_text(
        '"""Top.\n\nModules:\n\n- ``train``: a command\n\nFolders:\n\n- ``lab``: the lab\n"""\n'
    )
    (tmp_path / "gatherlab" / "train.py").write_text("")
    (folder / "__init__.py").write_text(
        '"""The lab.\n\nModules:\n\n- ``jobs``: one job\n- ``gone``: renamed\n"""\n'
    )
    (folder / "jobs.py").write_text("")
    (folder / "added.py").write_text("")
    assert _floor_plan_drift(tmp_path) == [
        "gatherlab/lab/__init__.py names modules the folder does not hold: ['gone']",
        "gatherlab/lab/__init__.py does not name the folder's modules ['added']",
    ]
    (tmp_path / "gatherlab" / "ranks").mkdir()
    (tmp_path / "gatherlab" / "ranks" / "__init__.py").write_text(
        '"""Ranks.\n\nModules:\n\n- ``pool``: pools\n"""\n'
    )
    (tmp_path / "gatherlab" / "ranks" / "pool.py").write_text("")
    assert _floor_plan_drift(tmp_path)[-1] == (
        "gatherlab/__init__.py names the folders ['lab'], the tree holds ['lab', 'ranks']"
    )


def _names_used_twice(source: Path) -> list[str]:
    """The module names of the package under ``source`` used more than once, but for a top-level
    module ``gatherlab/<name>.py`` that imports from the one module of a folder of the same name,
    whose public face it holds (``report`` and ``analysis/report``). ``__init__`` and
    ``__main__`` are every package's own."""
    package = source / "gatherlab"
    homes: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.stem not in ("__init__", "__main__"):
            homes.setdefault(path.stem, []).append(path.parent.relative_to(package).as_posix())
    clashes = []
    for name, folders in sorted(homes.items()):
        inner = [folder for folder in folders if folder != "."]
        if len(folders) == 1:
            continue
        if "." not in folders or len(inner) != 1:
            clashes.append(f"{name}: a module of {', '.join(sorted(folders))}")
            continue
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        if f"gatherlab.{inner[0].replace('/', '.')}.{name}" not in imported:
            clashes.append(f"{name}: gatherlab/{name}.py holds nothing of {inner[0]}/{name}.py")
    return clashes


def test_a_module_s_name_repeats_only_as_the_public_face_of_its_namesake():
    """One meaning per name: ``gatherlab/report.py`` is the public face of ``analysis/report.py``
    and ``gatherlab/bench.py`` the command of ``lab/bench.py``; any other repeated name is a
    clash."""
    assert _names_used_twice(REPO / "src") == []


def test_a_module_name_used_twice_is_found(tmp_path):
    package = tmp_path / "gatherlab"
    for folder in ("check", "analysis", "lab"):
        (package / folder).mkdir(parents=True)
    (package / "report.py").write_text("from gatherlab.analysis.report import main\n")
    (package / "analysis" / "report.py").write_text("")
    assert _names_used_twice(tmp_path) == []
    (package / "bench.py").write_text("from gatherlab.lab.jobs import main\n")
    (package / "lab" / "bench.py").write_text("")
    (package / "check" / "compare.py").write_text("")
    (package / "analysis" / "compare.py").write_text("")
    assert _names_used_twice(tmp_path) == [
        "bench: gatherlab/bench.py holds nothing of lab/bench.py",
        "compare: a module of analysis, check",
    ]


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
    # users: psutil is only a test dependency (the dev extra), ANTLR's runtime only comes with
    # Hydra (PyYAML, its example before, is declared since the config names its errors).
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "src" / "gatherlab" / "lab" / "tracking.py").open("a") as module:
        module.write("\nimport psutil\nimport antlr4\n")
    result = _deptry(tmp_path)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "DEP004 'psutil' imported but declared as a dev dependency" in output
    assert "DEP003 'antlr4' imported but it is a transitive dependency" in output
