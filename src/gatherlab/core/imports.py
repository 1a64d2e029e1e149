"""The object an import path names (a config's ``_target_``, ``--gather mod:fn``, a check's
``package.module:Class``): one resolver for every layer."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["locate"]


def locate(path: str) -> Any:
    """The object an import path names: ``package.module:attribute`` (the attribute may be
    dotted) or ``package.module.attribute``. A module that does not import or an attribute that
    is missing raises ``ImportError`` with one line that says which.

    Example:
        >>> from gatherlab.core.imports import locate
        >>> locate("gatherlab.core.terms:Style.LOCAL"), locate("gatherlab.core.terms.FLOAT64")
        (<Style.LOCAL: 'local'>, 1e-10)
        >>> locate("gatherlab.core.terms:Nothing")
        Traceback (most recent call last):
        ImportError: gatherlab.core.terms has no attribute 'Nothing'
    """
    if not isinstance(path, str) or not path.strip(" .:") or path.endswith((":", ".")):
        raise ImportError(f"{path!r} is not an import path; allowed: package.module:attribute")
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
