"""A pool's job runs on the caller's import path: its entries first, in the caller's order, so
that a rank imports a module from where the caller would, also when a directory that an earlier
job put on the rank's path holds a module of the same name (docs/design.md §4)."""

from __future__ import annotations

import importlib
import sys
import uuid

from gatherlab.ranks import pool


def test_a_rank_imports_a_module_from_where_the_caller_finds_it(tmp_path, monkeypatch):
    name = f"shadowed_{uuid.uuid4().hex}"  # imported nowhere yet, in no rank either
    for place in ("behind", "front"):
        (tmp_path / place).mkdir()
        (tmp_path / place / f"{name}.py").write_text(f"def where():\n    return {place!r}\n")
    workers = pool.pool(2)
    # a job while only "behind" is on the caller's path: the ranks' path holds it from then on
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "behind")])
    workers.run(len, "")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "front"), *sys.path])
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(name)
        assert module.where() == "front"  # the caller's import
        assert workers.run(module.where) == ["front", "front"]
    finally:
        sys.modules.pop(name, None)
