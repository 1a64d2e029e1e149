"""The object an import path names (a config's ``_target_``, ``--gather mod:fn``, a check's
``package.module:Class``): one resolver for every layer; and the import path on which another
process (a rank) imports what this one imported (`pickled`, `search_path`, `unfindable`); and a
place in the code as every rank shows it (`place`)."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import io
import os
import pickle
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["locate", "pickled", "place", "search_path", "unfindable"]


def locate(path: str) -> Any:
    """The object an import path names: ``package.module:attribute`` (the attribute may be
    dotted) or ``package.module.attribute``. A module that does not import or an attribute that
    is missing raises ``ImportError`` with one line that says which.

    Example:
        >>> from gatherlab.core.imports import locate
        >>> locate("gatherlab.core.terms:Style.LOCAL")
        <Style.LOCAL: 'local'>
        >>> locate("gatherlab.core.terms.EXACT_PRECISIONS")
        (<Precision.FLOAT64: '64-true'>, <Precision.FLOAT32: '32-true'>)
        >>> locate("gatherlab.core.terms:Nothing")
        Traceback (most recent call last):
        ImportError: gatherlab.core.terms has no attribute 'Nothing'
        >>> locate("mylib/loss.py:NTXent")
        Traceback (most recent call last):
        ImportError: 'mylib/loss.py:NTXent' is a file path; allowed: package.module:attribute
    """
    if not isinstance(path, str) or not path.strip(" .:") or path.endswith((":", ".")):
        raise ImportError(f"{path!r} is not an import path; allowed: package.module:attribute")
    if "/" in path or path.partition(":")[0].endswith(".py"):
        raise ImportError(f"{path!r} is a file path; allowed: package.module:attribute")
    if ":" in path:
        module_name, _, attributes = path.partition(":")
        target = _import(module_name)
    else:  # the longest prefix that is a module is the module, the rest are attributes
        parts = path.split(".")
        for split in range(len(parts), 0, -1):
            module_name = ".".join(parts[:split])
            try:
                target = importlib.import_module(module_name)
            except ModuleNotFoundError as error:
                if split > 1 and error.name and f"{module_name}.".startswith(f"{error.name}."):
                    continue  # this prefix is no module: its last part is an attribute
                raise ImportError(f"cannot import {module_name}: {error}") from None
            except Exception as error:
                raise _import_error(module_name, error) from None
            attributes = ".".join(parts[split:])
            break
    for attribute in filter(None, attributes.split(".")):
        if not hasattr(target, attribute):
            raise ImportError(f"{target.__name__} has no attribute {attribute!r}")
        target = getattr(target, attribute)
    return target


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # the module itself fails to import: say which and why
        raise _import_error(module_name, error) from None


def _import_error(module_name: str, error: Exception) -> ImportError:
    return ImportError(f"cannot import {module_name}: {type(error).__name__}: {error}")


class _NamingPickler(pickle.Pickler):
    """A pickler that notes the module of each class and function it pickles: pickle names them
    by module and qualified name, and the process that unpickles imports each module by name."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
            module = getattr(obj, "__module__", None)
            if isinstance(module, str):
                self.modules.add(module)
        return NotImplemented  # pickled as usual


def pickled(obj: Any) -> tuple[bytes, set[str]]:
    """``obj`` pickled, and the modules that the process unpickling it imports by name (those of
    the classes and functions it holds)."""
    buffer = io.BytesIO()
    pickler = _NamingPickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.modules


def _findable(name: str, path: Sequence[str]) -> bool:
    """Whether an import of the top-level module ``name`` finds it with ``path`` as the import
    path: this process's finders (``sys.meta_path``: built-in and frozen modules, an editable
    install's), the path's entries in place of ``sys.path``."""
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(name, list(path))
            else:
                spec = finder.find_spec(name, None)
        except Exception:  # a finder that fails finds nothing
            spec = None
        if spec is not None:
            return True
    return False


def _root(name: str) -> str | None:
    """The directory from which the module ``name`` this process imported is found by that name:
    its file's directory, one level up per dot of the name (and for a package, its own folder);
    None when it has no file or its file is not where its name says."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(file, str):
        return None
    directory = os.path.dirname(os.path.abspath(file))
    if os.path.splitext(os.path.basename(file))[0] == "__init__":
        directory = os.path.dirname(directory)
    for _ in range(name.count(".")):
        directory = os.path.dirname(directory)
    return directory if _findable(name.partition(".")[0], [directory]) else None


def search_path(modules: Iterable[str] = ()) -> list[str]:
    """The import path on which another process imports ``modules`` as this one imported them:
    ``sys.path`` with each entry absolute (a relative one, ``''`` included, names a directory of
    the current directory, which the other process need not share), then, for each module of
    ``modules`` that no entry finds by its name (this process imported it from a file by a spec,
    or through an entry since removed), the directory it is found from (when there is one)."""
    path = list(dict.fromkeys(_absolute(entry) for entry in sys.path if isinstance(entry, str)))
    for name in sorted(unfindable(modules, path)):
        root = _root(name)
        if root is not None and root not in path:
            path.append(root)
    return path


def _absolute(entry: str) -> str:
    """An entry of the import path as an absolute path when it is a relative one (``''`` is the
    current directory); any other entry as it is (a path hook's own name, an absolute path)."""
    if entry == "":
        return os.getcwd()
    return os.path.abspath(entry) if os.path.exists(entry) else entry


def unfindable(modules: Iterable[str], path: Sequence[str]) -> list[str]:
    """The modules of ``modules`` that an import on ``path`` does not find by name (``__main__``
    aside: every process has its own), in order."""
    modules = list(modules)
    found = {top: _findable(top, path) for top in {name.partition(".")[0] for name in modules}}
    return [name for name in modules if name != "__main__" and not found[name.partition(".")[0]]]


@functools.cache
def _shown(filename: str, search_path: tuple[str, ...], here: str) -> str:
    path = os.path.realpath(filename)
    roots = [os.path.realpath(os.path.join(here, entry)) + os.sep for entry in search_path]
    below = [root for root in roots if path.startswith(root)]
    if below:
        return os.path.relpath(path, max(below, key=len))
    package = os.path.dirname(path)  # loaded from a file: from its outermost package's parent
    while os.path.exists(os.path.join(package, "__init__.py")):
        package = os.path.dirname(package)
    return os.path.relpath(path, package)


def place(filename: str, line: int) -> str:
    """``file:line`` as the code's place is shown: relative to the import path entry it is found
    under, the nearest one (``pkg/module.py:12``: the same on every machine, from any directory,
    on every rank); a file no entry holds (loaded from its path) from its outermost package's
    parent directory."""
    return f"{_shown(filename, tuple(sys.path), os.getcwd())}:{line}"
