"""Table (docs/results.md, "Checks of public code"): ``gatherlab.check`` on the released code of
lightly and OpenCLIP, not on stand-ins.

Downloads the released wheels with ``pip download --no-deps`` (it needs the package registry; the
test suite does not) into ``~/.cache/gatherlab/public_code`` (``$XDG_CACHE_HOME`` when set),
unpacks from them only the files each loss needs, and loads those files on their own: the
packages' ``__init__`` imports torchvision, which cannot load beside this CPU torch. Then
``check_loss`` at W = 2 and 4 on:

- lightly's ``NTXentLoss(gather_distributed=True)``, releases 1.5.2 and 1.5.3 (their
  ``GatherLayer``'s backward keeps the own slice's gradient: predicted biased), 1.5.4, the first
  release with PR #1531, and 1.6.0 (the backward all-reduces every rank's gradients, then takes
  its own slice: predicted exact);
- OpenCLIP's ``ClipLoss`` (open-clip-torch 3.3.0) through ``OpenClipForCheck``, a wrapper written
  here that normalises the features and holds the logit scale: the default flags, ``local_loss``,
  ``gather_with_grad``, both, and a learnt logit scale.

The predictions are docs/design.md §1's, worked out from the released code before the run (each
case's ``predicted``); the script says when a verdict departs from one. It prints the table and
writes it into docs/results.md between ``<!-- public_code:start -->`` and
``<!-- public_code:end -->``.

The ranks are forked from the pool's fork server and import this file as the module
``public_code`` (the pool sends them this process's import path): the loss factories are its
top-level names, and each rank loads the released files itself, on its first build.

Usage: ``python experiments/public_code.py``
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.check import check_loss
from gatherlab.core.terms import GradientClass

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results.md"
START, END = "<!-- public_code:start -->", "<!-- public_code:end -->"
CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gatherlab" / "public_code"
)
WORLD_SIZES = (2, 4)

# The files each release's loss needs, relative to the wheel's root, in the order they are loaded
# (a file's own imports come first).
LIGHTLY_FILES = (
    "lightly/utils/dist.py",
    "lightly/models/modules/memory_bank.py",
    "lightly/loss/ntx_ent_loss.py",
)
OPEN_CLIP_FILES = ("open_clip/loss.py",)
OPEN_CLIP = "3.3.0"  # open-clip-torch: the newest release on the registry when this was written


# --- the released files ---------------------------------------------------------------------------


def download(package: str, version: str) -> Path:
    """The release's wheel, fetched by ``pip download --no-deps`` (pip checks it against the
    registry's hash)."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", f"{package}=={version}", "-d", str(wheels),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    name = package.replace("-", "_").lower()  # a wheel's name keeps the project's capitals
    found = sorted(
        w for w in wheels.glob(f"*-{version}-*.whl") if w.name.lower().startswith(name + "-")
    )
    if len(found) != 1:
        raise RuntimeError(f"pip download {package}=={version}: expected one wheel, found {found}")
    return found[0]


def release_root(package: str, version: str) -> Path:
    """Where a release's files are unpacked: ``<cache>/<package>-<version>``."""
    return CACHE / f"{package}-{version}"


def unpack(wheel: Path, package: str, version: str, files: tuple[str, ...]) -> Path:
    """``files`` of ``wheel`` extracted into the release's folder (its root)."""
    root = release_root(package, version)
    with zipfile.ZipFile(wheel) as archive:
        for name in files:
            archive.extract(name, root)
    return root


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- loading them on their own --------------------------------------------------------------------

_LOADED: dict[tuple[str, str], types.ModuleType] = {}
"""(release root, file) → the module loaded from it, once per process (each rank loads its own)."""


def synthetic(root: Path) -> str:
    """The package name a release's files are loaded under: its folder's name as an identifier."""
    return "_released_" + "".join(c if c.isalnum() else "_" for c in root.name)


def _package(name: str) -> types.ModuleType:
    package = types.ModuleType(name)
    package.__path__ = []  # a package with nothing to import on its own: its modules are set
    return package


def absent(name: str, why: str) -> types.ModuleType:
    """A module that is not loaded: any attribute asked of it raises, saying why."""
    stub = types.ModuleType(name)

    def __getattr__(attribute: str) -> Any:
        raise AttributeError(f"{name}.{attribute}: not loaded here ({why})")

    stub.__getattr__ = __getattr__  # PEP 562: asked for every attribute the module lacks
    return stub


@contextlib.contextmanager
def as_imported(modules: dict[str, types.ModuleType], loaded: list[str]) -> Iterator[None]:
    """``sys.modules`` answers the released files' own absolute imports (``from lightly.utils
    import dist``) with the modules given and, once each is loaded, the ``loaded`` names, while
    they execute; all those names are restored after, so that two releases of one package load in
    one process."""
    saved = {name: sys.modules.get(name) for name in (*modules, *loaded)}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load(
    root: Path, files: tuple[str, ...], stubs: dict[str, types.ModuleType]
) -> types.ModuleType:
    """Loads ``files`` of the release at ``root`` in order, each under the synthetic package
    (``_released_lightly_1_5_2.lightly.utils.dist``), the release's own module names answering
    their imports of each other; ``stubs`` answer the imports that are not loaded. Returns the
    last file's module."""
    key = (str(root), files[-1])
    if key in _LOADED:
        return _LOADED[key]
    prefix = synthetic(root)
    names: dict[str, types.ModuleType] = dict(stubs)
    for file in files:  # the packages above each file, empty
        parts = file.removesuffix(".py").split("/")
        for depth in range(1, len(parts)):
            names.setdefault(".".join(parts[:depth]), _package(".".join(parts[:depth])))
    for name, module in stubs.items():  # a stub is also its package's attribute
        parent, _, attribute = name.rpartition(".")
        parts = parent.split(".")
        for depth in range(1, len(parts) + 1):  # the packages above it, empty where no file is
            names.setdefault(".".join(parts[:depth]), _package(".".join(parts[:depth])))
        setattr(names[parent], attribute, module)
    module = None
    owns = [file.removesuffix(".py").replace("/", ".") for file in files]
    with as_imported(names, owns):
        for file, own in zip(files, owns, strict=True):
            spec = importlib.util.spec_from_file_location(f"{prefix}.{own}", root / file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            names[own] = sys.modules[own] = module
            parent, _, attribute = own.rpartition(".")
            setattr(names[parent], attribute, module)
            spec.loader.exec_module(module)
    _LOADED[key] = module
    return module


def lightly_loss_module(root: str | Path) -> types.ModuleType:
    """lightly's ``lightly/loss/ntx_ent_loss.py`` of the release at ``root``, with its imports:
    ``lightly/utils/dist.py`` (the ``GatherLayer``, ``rank``, ``world_size``, ``eye_rank``) and
    ``lightly/models/modules/memory_bank.py`` (the base class or member ``MemoryBankModule``; with
    ``memory_bank_size=0`` its forward returns its input and no bank).

    One stub: ``lightly.models.utils``, which memory_bank.py imports and which imports torchvision.
    memory_bank.py uses only its ``concat_all_gather``, and only to fill a memory bank
    (``memory_bank_size`` > 0), which the NT-Xent checked here has not; it is irrelevant to the
    loss, and any use of it raises."""
    why = "it imports torchvision; memory_bank.py uses it only to fill a memory bank"
    stubs = {"lightly.models.utils": absent("lightly.models.utils", why)}
    return load(Path(root), LIGHTLY_FILES, stubs)


def open_clip_loss_module(root: str | Path) -> types.ModuleType:
    """open_clip's ``open_clip/loss.py`` of the release at ``root``. No stubs: it imports torch
    and, optionally, horovod (absent here: ``hvd = None``, used only with ``use_horovod=True``)."""
    return load(Path(root), OPEN_CLIP_FILES, {})


# --- the losses as the check builds them in each rank ---------------------------------------------


def lightly_ntxent(root: str, **kwargs: Any) -> nn.Module:
    """lightly's released ``NTXentLoss(**kwargs)`` itself, from the release at ``root``. It asks
    torch.distributed for the rank and world size itself (``lightly.utils.dist``)."""
    return lightly_loss_module(root).NTXentLoss(**kwargs)


class OpenClipForCheck(nn.Module):
    """OpenCLIP's released ``ClipLoss`` (from the release at ``root``; by default open-clip-torch
    `OPEN_CLIP` as this script unpacked it) as gatherlab calls a loss, ``loss(z0, z1)``: the
    features normalised (the model normally does it) and the logit scale held here (``exp`` of a
    log scale from 1/0.07, CLIP's start; a parameter with ``learn_logit_scale``). ``rank`` and
    ``world_size`` are named so that gatherlab passes them, as OpenCLIP's training script passes
    its own. Also for the command line, once this script has run:
    ``PYTHONPATH=experiments python -m gatherlab.check public_code:OpenClipForCheck``."""

    def __init__(self, root=None, rank=0, world_size=1, learn_logit_scale=False, **flags):
        super().__init__()
        root = Path(root or release_root("open-clip-torch", OPEN_CLIP))
        if not (root / OPEN_CLIP_FILES[0]).is_file():
            raise FileNotFoundError(
                f"{root / OPEN_CLIP_FILES[0]} is missing: python experiments/public_code.py "
                "downloads the release"
            )
        self.loss = open_clip_loss_module(root).ClipLoss(rank=rank, world_size=world_size, **flags)
        scale = torch.tensor(1 / 0.07).log()
        if learn_logit_scale:
            self.logit_scale = nn.Parameter(scale)
        else:
            self.register_buffer("logit_scale", scale)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp())


# --- the cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    package: str
    version: str
    files: tuple[str, ...]
    factory: str  # a top-level name of this module
    label: str
    predicted: GradientClass  # docs/design.md §1, from the released code read before the run
    why: str
    kwargs: dict[str, Any] = field(default_factory=dict)


NTXENT = {"temperature": 0.5, "gather_distributed": True}
CLIP = ("open-clip-torch", OPEN_CLIP, OPEN_CLIP_FILES, "OpenClipForCheck")
CASES = (
    Case("lightly", "1.5.2", LIGHTLY_FILES, "lightly_ntxent", "NTXentLoss, gather_distributed",
         GradientClass.BIASED, "local style; GatherLayer's backward keeps the own slice", NTXENT),
    Case("lightly", "1.5.3", LIGHTLY_FILES, "lightly_ntxent", "NTXentLoss, gather_distributed",
         GradientClass.BIASED, "as 1.5.2: the last release before PR #1531", NTXENT),
    Case("lightly", "1.5.4", LIGHTLY_FILES, "lightly_ntxent", "NTXentLoss, gather_distributed",
         GradientClass.EXACT, "local style; backward all-reduces, then keeps the own slice",
         NTXENT),
    Case("lightly", "1.6.0", LIGHTLY_FILES, "lightly_ntxent", "NTXentLoss, gather_distributed",
         GradientClass.EXACT, "as 1.5.4", NTXENT),
    Case(*CLIP, "ClipLoss, default flags", GradientClass.ONE_OVER_W,
         "no-grad gather, live local slot, full loss on every rank"),
    Case(*CLIP, "ClipLoss, local_loss", GradientClass.BIASED,
         "own rows against no-grad columns (no live slot)", {"local_loss": True}),
    Case(*CLIP, "ClipLoss, gather_with_grad", GradientClass.EXACT,
         "full loss; torch.distributed.nn.all_gather sums in its backward",
         {"gather_with_grad": True}),
    Case(*CLIP, "ClipLoss, local_loss, gather_with_grad", GradientClass.EXACT,
         "own rows against gathered columns whose backward sums",
         {"local_loss": True, "gather_with_grad": True}),
    Case(*CLIP, "ClipLoss, default flags, learnt logit scale", GradientClass.BIASED,
         "model 1/W, the scale complete on every rank", {"learn_logit_scale": True}),
    Case(*CLIP, "ClipLoss, gather_with_grad, learnt logit scale", GradientClass.EXACT,
         "every part exact", {"gather_with_grad": True, "learn_logit_scale": True}),
)  # fmt: skip


def _number(value: Any) -> str:
    return "—" if value is None or pd.isna(value) else f"{value:.4g}"


def _parts(rows: pd.DataFrame) -> str:
    """Each part's gradient class, when the parts' classes differ."""
    parts = rows[rows["part"] != "all"]
    if parts["gradient"].nunique() < 2:
        return ""
    return ", ".join(f"{row.part} {row.gradient}" for row in parts.itertuples())


def rows_of(case: Case, table: pd.DataFrame) -> list[list[str]]:
    rows = []
    for world_size, at_w in table.groupby("world_size", sort=False):
        whole = at_w[at_w["part"] == "all"].iloc[0]
        rows.append([
            case.package, case.version, case.label, str(world_size), str(whole["verdict"]),
            str(whole["cause"] or ""), _parts(at_w), _number(whole["norm_ratio"]),
            _number(whole["cosine"]), case.predicted,
        ])  # fmt: skip
    return rows


COLUMNS = ("package", "version", "loss, flags", "W", "verdict", "cause", "parts", "norm ratio",
           "cosine", "predicted (design.md §1)")  # fmt: skip


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_into_results(text: str, start: str = START, end: str = END) -> None:
    """Replaces what lies between the markers ``start`` and ``end`` of docs/results.md (by
    default this script's) with ``text``."""
    document = RESULTS.read_text()
    if document.count(start) != 1 or document.count(end) != 1:
        raise RuntimeError(f"{RESULTS}: expected one {start} and one {end}")
    before, rest = document.split(start)
    _, after = rest.split(end)
    with tempfile.NamedTemporaryFile("w", dir=RESULTS.parent, delete=False) as new:
        new.write(f"{before}{start}\n{text}\n{end}{after}")
    os.replace(new.name, RESULTS)


def main() -> None:
    # the ranks import this file as ``public_code`` from the import path the pool sends them
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    releases, provenance = {}, []
    for case in CASES:
        key = (case.package, case.version)
        if key not in releases:
            wheel = download(case.package, case.version)
            releases[key] = unpack(wheel, case.package, case.version, case.files)
            provenance.append(f"{wheel.name} (sha256 {sha256(wheel)[:16]}…)")
    rows, departures = [], []
    for case in CASES:
        root = str(releases[(case.package, case.version)])
        table = check_loss(
            f"public_code:{case.factory}", WORLD_SIZES, root=root, **case.kwargs
        ).table
        for row in rows_of(case, table):
            rows.append(row)
            if row[4] != case.predicted:
                departures.append(f"{case.package} {case.version} {case.label}, W = {row[3]}: "
                                  f"{row[4]}, predicted {case.predicted} ({case.why})")  # fmt: skip
    text = markdown(rows) + "\n\nFrom the wheels " + ", ".join(provenance) + "."
    print(text)
    for line in departures:
        print(f"departs from the prediction: {line}")
    if not departures:
        print("every verdict is the predicted one")
    write_into_results(text)
    print(f"written: {RESULTS} (between {START} and {END})")


if __name__ == "__main__":
    main()
