"""The layers of docs/design.md §4, enforced: no module imports from a layer above its own, and
every module of the package has a layer (import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import contextlib
import io

from helpers import REPO
from importlinter.cli import lint_imports


def test_import_layers_are_kept():
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exit_code = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True)
    assert exit_code == 0, output.getvalue()[-3000:]
