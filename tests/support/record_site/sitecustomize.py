"""Who writes and logs, in every process a test starts with this folder first on its PYTHONPATH and
``GATHERLAB_RECORD`` naming a folder (tests/support/who_writes.py starts and reads it). Each process
appends one JSON line per event, ``[rank, what, detail]``, to ``<folder>/<pid>.jsonl``; its rank is
torchrun's ``RANK`` or srun's ``SLURM_PROCID``, None in a process that no launcher started (the
launcher itself). Recorded, and then done as before (nothing is replaced, only wrapped):

- ``runfiles.write_NAME``: gatherlab's writers of run files (``gatherlab.core.runfiles.write_*``:
  curves, summary, final state, tables such as check.csv), with the directory or file written;
- ``open``: every file opened for writing (``builtins.open``, ``io.open``, ``os.open`` with a
  writing flag), whoever opens it (Hydra, logging's file handlers, wandb), with its path;
- ``log``: every record a ``gatherlab`` logger handles, with the logger's name and the message.

``runfiles`` is wrapped when the process first imports it (an import hook), so that this file
imports nothing heavy and changes no import order (``python -m gatherlab.check`` starts its fork
server before torch is imported)."""

from __future__ import annotations

import os

if os.environ.get("GATHERLAB_RECORD"):
    import builtins
    import importlib.abc
    import importlib.util
    import io
    import json
    import logging
    import sys

    _RANK = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    _OPEN, _OS_OPEN, _HANDLE = builtins.open, os.open, logging.Logger.handle
    _RECORD = _OPEN(
        os.path.join(os.environ["GATHERLAB_RECORD"], f"{os.getpid()}.jsonl"), "a", buffering=1
    )
    _WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _record(what: str, detail: str) -> None:
        _RECORD.write(json.dumps([None if _RANK is None else int(_RANK), what, detail]) + "\n")

    def _path(path) -> str:
        return os.path.realpath(os.fsdecode(path))

    def _open(file, mode="r", *args, **kwargs):
        if isinstance(file, str | bytes | os.PathLike) and any(c in mode for c in "wax+"):
            _record("open", _path(file))
        return _OPEN(file, mode, *args, **kwargs)

    def _os_open(path, flags, *args, **kwargs):
        if flags & _WRITING:
            _record("open", _path(path))
        return _OS_OPEN(path, flags, *args, **kwargs)

    def _handle(self, record):
        if record.name == "gatherlab" or record.name.startswith("gatherlab."):
            _record("log", f"{record.name}: {record.getMessage()}")
        return _HANDLE(self, record)

    builtins.open = io.open = _open
    os.open = _os_open
    logging.Logger.handle = _handle

    def _recording_writer(name, function):
        def writer(*args, **kwargs):
            _record(f"runfiles.{name}", _path(args[1] if name == "write_table" else args[0]))
            return function(*args, **kwargs)

        return writer

    def _wrap_runfiles(module) -> None:
        for name in [name for name in vars(module) if name.startswith("write_")]:
            setattr(module, name, _recording_writer(name, getattr(module, name)))

    _WRAP = {"gatherlab.core.runfiles": _wrap_runfiles}

    class _WrapOnImport(importlib.abc.MetaPathFinder):
        """Finds the modules of ``_WRAP`` as the other finders do, and wraps each once loaded."""

        def find_spec(self, name, path=None, target=None):
            if name not in _WRAP:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _WRAP[name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _WrapOnImport())
