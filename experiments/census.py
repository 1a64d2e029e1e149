"""Table (docs/results.md, "A census of released code"): ``gatherlab.check`` on every
distributed loss of the released packages the census could load, at W = 2 and 4 (a finding, a
case with a reproducer, and its fixed copy at W = 8 too), with the released defaults and each
distributed flag on and off; every row that is not exact checked again with its fix applied to a
local copy of the released file (a row whose loss is only scaled too, when it has a fix: a fix
of the value). A loss that calls the model itself (GradCache's: it backpropagates inside its
forward and replays the cached gradients in a hook of the loss it returns) is checked on that
path, its adapter's ``model_for`` giving it the model DDP wraps (docs/checking.md §6, "A loss that
calls the model itself").

The cases, one module per package, their adapters, stubs, remarks and fixes (patch files) are in
``experiments/census_cases/``. This script downloads each release's wheel as
``experiments/public_code.py`` does (``pip download --no-deps`` into
``~/.cache/gatherlab/public_code``: it needs the package registry; the test suite does not),
unpacks it whole into ``<cache>/<package>-<version>``, copies it to
``<cache>/<package>-<version>+<fix>`` with a case's fix applied by ``git apply`` (a patch that
does not apply stops the script; a case's ``patch``, a change the check itself needs such as
float64 or CPU, is applied the same way before its first check and said in the notes under the
table), and runs ``check_loss`` on each case in the ranks of the warm pool, which import the
case's module and load only the files each loss needs. It prints the table and the run time,
and writes the table into docs/results.md between ``<!-- census:start -->`` and
``<!-- census:end -->`` when it differs from what is there.

Usage: ``python experiments/census.py`` (``--check``: write nothing, print the difference and
exit 1 when the committed table is not today's; ``--only TEXT``: only the cases whose
``package version loss`` contains TEXT, printed, not written)
"""

from __future__ import annotations

import argparse
import difflib
import functools
import hashlib
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the ranks import census_cases and public_code from here too
    sys.path.insert(0, str(HERE))

from census_cases import CASES, NOT_RUN  # noqa: E402
from census_cases.common import Case, Fix, fixed_copy  # noqa: E402
from census_pages import Checked, pages  # noqa: E402
from public_code import RESULTS, download, release_root, sha256, write_into_results  # noqa: E402

from gatherlab.check import check_loss  # noqa: E402
from gatherlab.check.options import CheckError  # noqa: E402

START, END = "<!-- census:start -->", "<!-- census:end -->"
WORLD_SIZES = (2, 4)  # the table's
FINDING_WORLD_SIZES = (2, 4, 8)  # a finding's (a case with a reproducer): its page shows W = 8 too
REPRO = "experiments/census_repro"


def unpack_all(wheel: Path, package: str, version: str) -> Path:
    """Every file of ``wheel`` extracted into the release's folder, once."""
    root = release_root(package, version)
    done = root / ".unpacked"
    if not done.is_file():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(root)
        done.write_text(wheel.name)
    return root


def check(case: Case, root: Path) -> pd.DataFrame | str:
    """The check's table of ``case`` on the release at ``root``, or the error that stopped it."""
    if case.gather:  # the released gather, checked with a loss of gatherlab's
        factory, kwargs = case.factory, dict(case.kwargs)
        gather = functools.partial(case.gather, root=str(root))
    else:
        factory, kwargs, gather = (
            f"{case.factory.__module__}:{case.factory.__qualname__}",
            {**case.kwargs, "root": str(root)},
            None,
        )
    world_sizes = FINDING_WORLD_SIZES if case.repro else WORLD_SIZES
    try:
        return check_loss(
            factory, world_sizes, gather=gather, inputs=case.inputs, steps=case.steps, **kwargs
        ).table
    except CheckError as error:
        return f"failed on one device: {str(error).splitlines()[0]}"


def _number(value: Any) -> str:
    return "—" if value is None or pd.isna(value) else f"{value:.3g}"


def verdicts(table: pd.DataFrame | str) -> list[str]:
    """Per W of the table (`WORLD_SIZES`), the verdict with its numbers (cosine, norm ratio; the
    loss's relative difference when the forward differs)."""
    if isinstance(table, str):
        return [table] * len(WORLD_SIZES)
    cells = []
    shown = table[table["world_size"].isin(WORLD_SIZES)]
    for _, at_w in shown.groupby("world_size", sort=False):
        whole = at_w[at_w["part"] == "all"].iloc[0]
        verdict = str(whole["verdict"])
        if verdict == "exact":
            cells.append(verdict)
        elif verdict == "failed":
            cells.append(f"failed: {whole['error']}")
        else:
            numbers = f"cos {_number(whole['cosine'])}, norm {_number(whole['norm_ratio'])}"
            if whole["forward"] == "differs":
                numbers = f"Δloss {_number(whole['loss_diff'])}, " + numbers
            if verdict == "loss scaled":
                numbers = f"×{_number(whole['scale'])}"
            cells.append(f"{verdict} ({numbers})")
    return cells


def named(table: pd.DataFrame | str) -> str:
    """The cause and the ``where`` line the check named, at the first W that is not exact."""
    if isinstance(table, str):
        return ""
    for _, row in table[table["part"] == "all"].iterrows():
        if row["verdict"] in ("exact", "failed"):
            continue
        words = [str(row["cause"])] if isinstance(row["cause"], str) and row["cause"] else []
        if isinstance(row["where"], str) and row["where"]:
            words.append(f"`{row['where'].strip()}`")
        return "; ".join(words)
    return ""


def exact(table: pd.DataFrame | str) -> bool:
    """Whether the case trains like one device at every W: ``exact``, or ``loss scaled`` (only
    the value reported is a multiple of one device's; the gradient is exact)."""
    if isinstance(table, str):
        return False
    whole = table[table["part"] == "all"]
    return bool(whole["verdict"].isin(["exact", "loss scaled"]).all())


def one_devices(table: pd.DataFrame | str) -> bool:
    """Whether the case is one device's at every W, its value as well as its gradient: every
    verdict ``exact``. A case with a fix is checked with it whenever it is not: a fix of the
    value alone (`loss scaled`) is checked too, on the path the gradient takes."""
    if isinstance(table, str):
        return False
    return bool((table[table["part"] == "all"]["verdict"] == "exact").all())


COLUMNS = ("package", "version", "loss", "flags", "W = 2", "W = 4", "cause; where",
           "fix", "with the fix (W = 2, 4)", "reproducer")  # fmt: skip


def row_of(case: Case, table: pd.DataFrame | str, fixed: pd.DataFrame | str | None) -> list[str]:
    fix, after = "", ""
    if fixed is not None:
        fix = case.fix.summary
        after = "exact" if one_devices(fixed) else " / ".join(verdicts(fixed))
    elif not exact(table):
        fix = case.note
    repro = f"[{case.repro}]({'../' + REPRO}/{case.repro})" if case.repro else ""
    return [case.package, case.version, f"`{case.loss}`", case.flags, *verdicts(table),
            named(table), fix, after, repro]  # fmt: skip


def census_row(
    case: Case,
    root: Path,
    checked: Callable[[Case, Path], pd.DataFrame | str] = check,
    copied: Callable[[Path, Fix, str], Path] = fixed_copy,
    kept: list[Checked] | None = None,
) -> list[str]:
    """The table's row of ``case`` on the release at ``root``: its check (``checked``; on the
    release with the case's own ``patch`` applied, by ``copied``, when it has one) and, when that
    is not exact at every W (a scaled loss included: its fix is of the value), the check again on
    a copy with its fix applied, at the same world sizes (`check`); both tables added to
    ``kept``, for the pages."""
    label = hashlib.sha256(f"{case.loss} {case.flags}".encode()).hexdigest()[:8]
    if case.patch is not None:
        root = copied(root, case.patch, f"{case.patch.name}-{label}")
    table = checked(case, root)
    fixed = None
    if case.fix is not None and not one_devices(table):
        fixed = checked(case, copied(root, case.fix, f"{case.fix.name}-{label}"))
    if kept is not None:
        kept.append(Checked(case, table, fixed, root))
    return row_of(case, table, fixed)


def markdown(rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(text) for text in row) + " |" for row in rows]
    return "\n".join(lines)


def notes(cases: list[Case]) -> list[str]:
    """The notes under the table: each case's remark, in the cases' order."""
    return [f"- {case.package} {case.version} `{case.loss}` ({case.flags}): {case.remark}."
            for case in cases if case.remark]  # fmt: skip


def committed() -> str:
    """What docs/results.md holds between the census's markers."""
    document = RESULTS.read_text()
    return document.split(START, 1)[1].split(END, 1)[0].strip("\n")


def publish(text: str, check: bool) -> int:
    """``text`` into docs/results.md if it is not what the file holds; with ``check``, nothing
    written: the difference printed and 1 returned when there is one."""
    old = committed()
    if text == old:
        print(f"current: docs/results.md (between {START} and {END})")
        return 0
    if check:
        diff = difflib.unified_diff(
            (old + "\n").splitlines(keepends=True), (text + "\n").splitlines(keepends=True),
            "docs/results.md (census, committed)", "census (today)",
        )  # fmt: skip
        print("".join(diff))
        return 1
    write_into_results(text, START, END)
    print(f"written: docs/results.md (between {START} and {END})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only the cases whose 'package version loss' has this")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the table is stale"
    )
    args = parser.parse_args()
    if args.check and args.only:
        parser.error("--check compares the whole table: without --only")
    only = args.only
    cases = [c for c in CASES if not only or only in f"{c.package} {c.version} {c.loss}"]
    started = time.perf_counter()
    releases: dict[tuple[str, str], Path] = {}
    provenance = []
    for case in cases:  # each case's release and the wheels it needs, each once
        for package, version in ((case.package, case.version), *case.needs):
            if (package, version) not in releases:
                wheel = download(package, version)
                releases[(package, version)] = unpack_all(wheel, package, version)
                provenance.append(f"{wheel.name} (sha256 {sha256(wheel)[:16]}…)")
    rows: list[list[str]] = []
    kept: list[Checked] = []
    for number, case in enumerate(cases, 1):
        rows.append(census_row(case, releases[(case.package, case.version)], kept=kept))
        print(f"[{number}/{len(cases)}] {' | '.join(rows[-1][:8])}", flush=True)
    for skipped in NOT_RUN:
        rows.append([skipped.package, skipped.version, f"`{skipped.loss}`", "—",
                     "not run", "not run", skipped.reason, "", "", ""])  # fmt: skip
    below = notes(cases)
    text = (
        markdown(rows)
        + ("\n\nNotes:\n\n" + "\n".join(below) if below else "")
        + "\n\nFrom the wheels "
        + ", ".join(provenance)
        + "."
    )
    print(text)
    seconds = time.perf_counter() - started
    print(f"the census ran in {seconds:.0f} s")
    if only:
        return 0
    return max(publish(text, args.check), publish_pages(pages(kept), args.check))


def publish_pages(written: dict[Path, str], check: bool) -> int:
    """The findings' pages (`census_pages`) into docs/findings/, those that differ, and any page
    no finding has any more removed; with ``check``, nothing written: 1 when one differs."""
    folder = next(iter(written)).parent
    stale = [path for path in sorted(folder.glob("*.md")) if path not in written]
    changed = [path for path, text in written.items()
               if not path.is_file() or path.read_text() != text]  # fmt: skip
    for path in changed + stale:
        print(f"{'stale' if check else 'written'}: {path}")
    if check:
        return int(bool(changed or stale))
    folder.mkdir(parents=True, exist_ok=True)
    for path in changed:
        path.write_text(written[path])
    for path in stale:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
