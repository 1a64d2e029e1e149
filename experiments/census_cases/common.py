"""What the census's package modules share: a case and its fix, the stubs an adapter gives the
released files for what they import and the loss does not use, and where a release lies.

A fix is a unified diff (``fixes/<package>/<what>.patch``, ``a/`` and ``b/`` paths relative to
the wheel's root) applied to a fresh copy of the release by ``git apply`` (`fixed_copy`). git
apply rather than GNU patch: it applies a patch whole or not at all and takes no fuzz by
default, so a patch whose context the release does not hold stops the census instead of landing
a few lines off; and every checkout of this repository has git.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from public_code import absent, release_root
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FIXES = Path(__file__).resolve().parent / "fixes"
EINOPS = (
    "0.8.2"  # a dependency of x-clip and CoCa-pytorch, absent here: its wheel is put on the path
)


@dataclass(frozen=True)
class Fix:
    """A change tried on a copy of the released files: the unified diff ``fixes/<patch>``,
    against the released file (for a case with a ``patch`` of its own, against the release so
    patched), made with ``diff -u`` or ``git diff`` (paths ``a/<file>``, ``b/<file>`` relative
    to the wheel's root). Code it adds that needs a collective whose backward sums the ranks'
    gradients imports it from ``census_fixes`` (``all_reduce_sum``, ``all_gather_rows``), on
    the ranks' import path with this package."""

    summary: str  # the fix in one line, for the table
    patch: str  # the diff's path under experiments/census_cases/fixes/

    @property
    def name(self) -> str:
        """The patch file's name without ``.patch``: the fixed copy is ``<release>+<name>-…``."""
        return Path(self.patch).stem


@dataclass(frozen=True)
class Case:
    """One row of the table: a released loss (or gather) with its flags, and what the census
    does with it."""

    package: str
    version: str
    loss: str  # the released class or function
    flags: str  # the flags as the table shows them
    factory: Callable[..., nn.Module] | str  # called on each rank with root= and kwargs; with
    # ``gather``, the import path of a loss of gatherlab's, given the released gather
    kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # for a loss with state: the check's --steps
    fix: Fix | None = None  # tried when the row is not exact
    repro: str = ""  # experiments/census_repro/<name>.py, for a finding
    note: str = ""  # what the fix column says when there is no fix to try (a flag that is off)
    gather: Callable[..., Any] | None = None  # a released gather, checked with ``factory``
    needs: tuple[tuple[str, str], ...] = ()  # other wheels put on the ranks' import path
    patch: Fix | None = None  # applied before the check: the row is of the patched release
    remark: str = ""  # a note under the table
    inputs: Callable[..., Any] | None = None  # the loss's further inputs (check_loss's inputs=)
    threads: tuple[tuple[str, str], ...] = ()  # public threads it answers: (address, the answer)


@dataclass(frozen=True)
class NotRun:
    """A package or loss the census could not check, with its one-line reason."""

    package: str
    version: str
    loss: str
    reason: str


def flags_text(flags: dict[str, Any]) -> str:
    """Keyword arguments as the table's flags column shows them: ``a=1, b=True``."""
    return ", ".join(f"{key}={value}" for key, value in flags.items()) or "defaults"


def fixed_copy(root: Path, fix: Fix, label: str) -> Path:
    """A copy of the release at ``root``, ``<root>+<label>``, made afresh, with ``fix``'s patch
    applied by ``git apply`` (strict: it raises when the patch does not apply)."""
    copy = root.with_name(f"{root.name}+{label}")
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(root, copy)
    patch = FIXES / fix.patch
    done = subprocess.run(
        ["git", "apply", "--verbose", str(patch)], cwd=copy, capture_output=True, text=True
    )
    # inside a git work tree, git apply skips (and says so) a path outside the current folder
    if done.returncode != 0 or "Skipped" in done.stderr:
        raise RuntimeError(f"{fix.summary}: {patch} does not apply to {root}:\n{done.stderr}")
    return copy


def root_of(root: str | Path | None, package: str, version: str) -> Path:
    """``root``, or where the census unpacks the release (for the command line: the census must
    have run once)."""
    root = Path(root) if root else release_root(package, version)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is missing: python experiments/census.py unpacks it")
    return root


def stubs(**why: str) -> dict[str, types.ModuleType]:
    """``absent`` stubs, one per module name (dots written as ``__``), with why each is one."""
    names = {name.replace("__", "."): text for name, text in why.items()}
    return {name: absent(name, text) for name, text in names.items()}


def shim(name: str, why: str, **attributes: Any) -> types.ModuleType:
    """A stub (``absent``) that holds ``attributes``: the names the loaded files import from it."""
    module = absent(name, why)
    module.__path__ = []  # also a package, for the stubs below it
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    return module


def released_functions(root: Path, file: str, *names: str, **namespace: Any) -> dict[str, Any]:
    """The functions ``names`` of the released ``file`` alone, compiled from its source at their
    own lines (so that a trace names ``file:line`` as in the release), for a file whose other
    imports are absent here (torchvision); ``namespace``: the names their bodies and annotations
    use. Every other statement of the file is left out."""
    path = root / file
    tree = ast.parse(path.read_text(), str(path))
    wanted = [node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in names]  # fmt: skip
    missing = set(names) - {node.name for node in wanted}
    if missing:
        raise LookupError(f"{path} defines no {', '.join(sorted(missing))}")
    scope = dict(namespace)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), scope)
    return {name: scope[name] for name in names}


def unused(name: str, why: str) -> Callable[..., Any]:
    """A function the loaded files import and the loss never calls: calling it raises."""

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: not loaded here ({why})")

    return unused


def importable(root: Path, package: str) -> None:
    """The release's folder first on this process's import path: a package whose imports need
    nothing absent here (no torchvision) is imported as its users import it, ``__init__`` and
    all. A copy of it imported from another folder (the release, then its fixed copy, or the
    one installed here) is forgotten first. The other folders stay on the path, behind it: an
    installed copy's folder (site-packages) holds what later cases import."""
    loaded = sys.modules.get(package)
    if loaded is not None and not str(loaded.__file__).startswith(str(root) + "/"):
        for name in [name for name in sys.modules if name.split(".")[0] == package]:
            del sys.modules[name]
    sys.path[:] = [str(root), *(entry for entry in sys.path if entry != str(root))]


def _stand_in(name: str) -> types.ModuleType:
    """One module of `torchvision_stand_in`: a package (``__path__``, so that the import
    statement finds its submodules) whose every other attribute, when asked, raises one line."""
    module = types.ModuleType(name, f"{name}: an import-only stand-in (torchvision is not loaded)")
    module.__path__ = []

    def __getattr__(attribute: str) -> Any:
        if attribute.startswith("__"):  # what import statements, pickle and inspect probe
            raise AttributeError(attribute)
        raise AttributeError(f"torchvision is a stand-in here: {name}.{attribute} is not loaded")

    module.__getattr__ = __getattr__  # PEP 562: asked for every attribute the module lacks
    return module


def torchvision_stand_in(*submodules: str) -> dict[str, types.ModuleType]:
    """Import-only stand-ins for ``torchvision`` and its ``submodules`` (``"models"``,
    ``"transforms"``), for released files that import torchvision (which cannot load beside this
    torch, and is not installed) and whose loss path calls none of it: ``import torchvision``
    and ``from torchvision import models`` work (each submodule is its parent's attribute), and
    any other attribute used (``torchvision.models.resnet18``) raises ``AttributeError:
    torchvision is a stand-in here: torchvision.models.resnet18 is not loaded`` (a name a
    ``from`` import asks for, ``from torchvision.models import resnet18``, fails that import:
    ImportError, cannot import name). A row
    that loads files with it says so in its flags or remark ("torchvision an import-only
    stand-in")."""
    modules = {"torchvision": _stand_in("torchvision")}
    for submodule in submodules:
        parts = submodule.split(".")
        for depth in range(1, len(parts) + 1):
            name = "torchvision." + ".".join(parts[:depth])
            if name not in modules:
                modules[name] = _stand_in(name)
                parent, _, attribute = name.rpartition(".")
                setattr(modules[parent], attribute, modules[name])
    return modules


# --- a loss that calls the model itself (GradCache) ---------------------------------------------


def hand_model(loss: nn.Module, model: nn.Module) -> None:
    """Put ``model``, the module training hands a loss that calls the model itself (the check's
    DDP wrapper of it on real ranks: `gatherlab.runs.loss.calls_model`), in ``loss`` in place of
    the bare module the loss was built with, as sentence-transformers' trainer does once it has
    wrapped the model in DDP (pylate trains with that trainer too): every module under ``loss``
    whose ``model`` is the bare one is given the wrapper, and the bare one's ``preprocess``, which
    a wrapper lacks and a cross-encoder loss calls, is reachable from the wrapper. On one device
    ``model`` is the bare module and nothing changes."""
    if not isinstance(model, DistributedDataParallel):
        return
    bare = model.module
    if hasattr(bare, "preprocess") and not hasattr(model, "preprocess"):
        model.preprocess = bare.preprocess
    holders = [module for module in loss.modules() if getattr(module, "model", None) is bare]
    for holder in holders:
        holder.model = model
