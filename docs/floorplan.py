"""The floor plan of the package: docs/design.md §4's table of layers, made from the folders' own
docstrings (``python docs/floorplan.py``).

Each package's ``__init__`` docstring names its modules, one role each, as a list after a line
``Modules:`` (the top level's also its folders, after ``Folders:``)::

    Modules:

    - ``name``: what the module holds, in one line

The layers, top first, are the import-linter contract's in pyproject.toml (the one the lint
enforces); this module puts each layer's folders and top-level modules in that order, and each
folder's modules in its docstring's order, into the table between ``<!-- layers:start -->`` and
``<!-- layers:end -->`` in docs/design.md. ``python docs/floorplan.py`` rewrites the table;
``--check`` writes nothing and exits with status 1 when the committed table is not the one the
docstrings make (a unified diff). tests/journeys/test_architecture.py holds the docstrings to the
tree (every ``.py`` file of a folder named, ``__main__`` included, nothing else) and the table to
the docstrings.

It lives beside the file it writes (docs/), as docs/examples.py does.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "src" / "gatherlab"
DESIGN = REPO / "docs" / "design.md"
START, END = "<!-- layers:start -->", "<!-- layers:end -->"
# A layer's name in the table, by the first folder or module of its line in pyproject.toml.
LAYER_NAMES = {
    "train": "public face",
    "lab": "the lab",
    "check": "the check, analysis",
    "recording": "a job's record",
    "runs": "training",
    "components": "components, losses",
    "gather": "gathers",
    "ranks": "running ranks",
    "core": "the words",
}
TOP_LEVEL = "top level"
ITEM = re.compile(r"- ``(?P<name>\w+)``: (?P<role>\S.*)")


class FloorPlanError(ValueError):
    """A docstring whose list of modules (or folders) cannot be read."""


def listed(package: Path, heading: str = "Modules") -> dict[str, str]:
    """name → role of the list after the line ``heading:`` in the docstring of ``package``'s
    ``__init__.py``, in its order: a blank line, then one ``- ``name``: role`` per line up to the
    first line that is not one."""
    init = package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    lines = docstring.splitlines()
    if f"{heading}:" not in lines:
        raise FloorPlanError(f"{init.relative_to(REPO)}: its docstring has no line '{heading}:'")
    start = lines.index(f"{heading}:") + 1
    roles: dict[str, str] = {}
    for line in lines[start + 1 :]:
        item = ITEM.fullmatch(line)
        if item is None:
            break
        if item["name"] in roles:
            raise FloorPlanError(f"{init.relative_to(REPO)}: {item['name']} is listed twice")
        roles[item["name"]] = item["role"]
    if lines[start : start + 1] != [""] or not roles:
        raise FloorPlanError(
            f"{init.relative_to(REPO)}: '{heading}:' is not followed by a blank line and a list "
            "of '- ``name``: role'"
        )
    return roles


def floor_plan(source: Path = SOURCE) -> dict[str, dict[str, str]]:
    """folder → (module → role) as the docstrings of the package under ``source`` name them;
    ``""`` is the top level."""
    plan = {"": listed(source)}
    for init in sorted(source.glob("*/__init__.py")):
        plan[init.parent.name] = listed(init.parent)
    return plan


def modules(source: Path = SOURCE) -> dict[str, set[str]]:
    """folder → the modules it holds in the tree (its ``.py`` files but ``__init__``); ``""`` is
    the top level."""
    tree = {"": {path.stem for path in source.glob("*.py")} - {"__init__"}}
    for init in sorted(source.glob("*/__init__.py")):
        tree[init.parent.name] = {path.stem for path in init.parent.glob("*.py")} - {"__init__"}
    return tree


def layers(pyproject: Path = REPO / "pyproject.toml") -> list[list[str]]:
    """The layers of the import-linter contract, top first: each a list of folders and top-level
    modules."""
    contract = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    (layered,) = [c for c in contract["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.split("|")] for layer in layered["layers"]]


def _markdown(role: str) -> str:
    """A docstring's role as a table cell: ``code`` as `code`, a '|' escaped."""
    return re.sub(r"``([^`]+)``", r"`\1`", role).replace("|", "\\|")


def table(source: Path = SOURCE, pyproject: Path = REPO / "pyproject.toml") -> str:
    """The table of layers: a row per module, the layer named on its first row, a folder on its
    first row (``top level``: the modules of the package's top level)."""
    plan = floor_plan(source)
    rows = ["| layer | folder | module | what it holds |", "|---|---|---|---|"]
    for layer in layers(pyproject):
        if layer[0] not in LAYER_NAMES:
            raise FloorPlanError(f"the layer of {layer[0]} has no name in LAYER_NAMES")
        layer_cell, previous = LAYER_NAMES[layer[0]], None
        for name in layer:
            if name in plan:  # a folder
                folder, entries = f"`{name}/`", list(plan[name].items())
            elif name in plan[""]:
                folder, entries = TOP_LEVEL, [(name, plan[""][name])]
            else:
                raise FloorPlanError(f"{name}, a layer's in pyproject.toml, is in no docstring")
            for module, role in entries:
                folder_cell = folder if folder != previous else ""
                rows.append(f"| {layer_cell} | {folder_cell} | `{module}` | {_markdown(role)} |")
                layer_cell, previous = "", folder
    return "\n".join(rows) + "\n"


def committed(design: Path = DESIGN) -> str:
    """The table between the markers of docs/design.md."""
    text = design.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip("\n") + "\n"


def write(design: Path = DESIGN) -> None:
    text = design.read_text()
    before, after = text[: text.index(START) + len(START)], text[text.index(END) :]
    design.write_text(f"{before}\n{table()}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    arguments = parser.parse_args(argv)
    if not arguments.check:
        write()
        return 0
    made, written = table(), committed()
    if made == written:
        return 0
    diff = difflib.unified_diff(written.splitlines(), made.splitlines(), "design.md", "docstrings")
    print("\n".join(diff))
    return 1


if __name__ == "__main__":
    sys.exit(main())
