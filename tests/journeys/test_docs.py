"""The docs cannot drift from the code: every citation of a section of the design (docs/design.md,
contract.md, checking.md, recording.md: one numbering over four files) names one that its file
holds, every path of a .py file that the docs cite is a file, every link with an anchor finds its
heading, contract.md §5 names every file and column the run files module defines, every example in
a docstring runs and prints what it shows, and the printed outputs of README.md and docs/usage.md
that need no float64 rounding are what the code prints today (docs/examples.py; ``make examples``
regenerates them all)."""

from __future__ import annotations

import copy
import difflib
import doctest
import importlib
import importlib.util
import pkgutil
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

import gatherlab
from gatherlab.core import runfiles, terms

REPO = Path(__file__).resolve().parents[2]
# The design: four files, one numbering of sections (docs/design.md's contents: which holds which).
DESIGN = {
    stem: REPO / "docs" / f"{stem}.md" for stem in ("design", "contract", "checking", "recording")
}
MARKDOWN = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "experiments" / "README.md",
)
# Where code and docs cite the design: the package, its tests, experiments, configs, notebooks and
# build files, and the Markdown docs.
CITING = (
    *(path for folder in ("src", "tests", "examples", "experiments", "conf", "notebooks",
                                   "docs")
      for path in sorted((REPO / folder).rglob("*"))
      if path.suffix in {".py", ".yaml", ".ipynb", ".md"}),
    REPO / "Makefile", REPO / "pyproject.toml", REPO / "README.md",
)  # fmt: skip
# "docs/contract.md §5", "design §4", "[docs/checking.md §6](...)", "design.md §2, §7", "§2 and
# §7", a citation wrapped over a comment's or docstring's lines: the file, its first section, the
# sections that continue it. Inside the four files every other "§N" cites a section of the design.
CITATION = re.compile(
    r"\b(design|contract(?=\.md)|checking(?=\.md)|recording(?=\.md))(?:\.md)?\)?[\s#*]*§(\d+)"
    r"((?:[\s#]*(?:,|and|or)[\s#]*§\d+)*)"
)
SECTION = re.compile(r"§(\d+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A file of the repository cited by its path from the repository's root (``tests/gather/x.py``),
# in the docs and in the package's docstrings and comments; a pattern (``experiments/<name>.py``,
# ``tests/*.py``) is no path.
CITED_PATH = re.compile(r"(?<![\w/.-])((?:tests|src|experiments|examples)/[\w./-]*\.py)\b")
PATH_CITING = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "src").rglob("*.py")),
)
FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
# The cheap examples the suite checks (a few seconds each, no float64 rounding in what they print).
CHECKED_EXAMPLES = ("bad_value", "plain_step", "collectives")
# Those whose block is what the command prints on stdout, run in the test process on the warm pools
# (in an empty directory, the examples on the path as PYTHONPATH puts them): a fresh interpreter
# adds to what a terminal shows only what it prints on stderr (a warning at import), which the
# other block is; `make examples` runs every block in a fresh interpreter.
IN_PROCESS_EXAMPLES = ("plain_step", "tensor_parallel", "collectives")


def design_sections() -> dict[str, set[int]]:
    """file (its stem) → the sections it holds."""
    return {
        stem: {int(n) for n in re.findall(r"^## (\d+)\. ", path.read_text(), re.MULTILINE)}
        for stem, path in DESIGN.items()
    }


def citations(text: str, whole_file: bool) -> list[tuple[int, str | None, int]]:
    """(line, file, section) of every citation of the design in ``text``: the file a citation
    names (``design``, ``contract``, ...); ``whole_file`` (one of the design's files): also every
    other §N, whose file is None (any of the four)."""
    matches = []
    cited = []
    for match in CITATION.finditer(text):
        cited.append(match.span())
        matches.append((match.start(), match.group(1), match.group(2)))
        matches += [(match.start(), match.group(1), n) for n in SECTION.findall(match.group(3))]
    if whole_file:
        matches += [
            (m.start(), None, m.group(1))
            for m in SECTION.finditer(text)
            if not any(start <= m.start() < end for start, end in cited)
        ]
    found = [(text.count("\n", 0, at) + 1, file, int(number)) for at, file, number in matches]
    return sorted(found, key=lambda cited: (cited[0], cited[1] or "", cited[2]))


def test_every_citation_of_design_names_a_section_that_exists():
    sections = design_sections()
    every = set().union(*sections.values())
    assert sorted(every) == list(range(1, 12)) == sorted(n for s in sections.values() for n in s)
    stale = []
    for path in CITING:
        text = path.read_text(errors="replace")
        name = path.relative_to(REPO).as_posix()
        for line, file, section in citations(text, whole_file=path in DESIGN.values()):
            if section in (every if file is None else sections[file]):
                continue
            where = "the design" if file is None else f"docs/{file}.md"
            stale.append(f"{name}:{line}: §{section} ({where})")
    assert not stale, f"citations of sections their file does not hold: {stale}"


def test_a_stale_citation_is_found():
    """The pattern sees the forms the code uses, so the test above can fail."""
    # the numbers not written out, so that this file cites no section a file of the design lacks
    a, b, two, five, six, seven, eight = 42, 43, 2, 5, 6, 7, 8
    text = (
        f"x (docs/design.md §{a})\n# docs/contract.md §{two},\n# §{b} and §{five}\n"
        f"[design §{six}](d#a), checking.md §{seven}; checking §{eight}, recording.md §{a}"
    )
    assert citations(text, whole_file=False) == [
        (1, "design", 42), (2, "contract", 2), (2, "contract", 5), (2, "contract", 43),
        (4, "checking", 7), (4, "design", 6), (4, "recording", 42),
    ]  # fmt: skip
    assert citations(f"§{five}, contract.md §{six}", whole_file=True) == [
        (1, None, 5), (1, "contract", 6),
    ]  # fmt: skip


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of every file path ``text`` cites."""
    return [
        (text.count("\n", 0, match.start()) + 1, match.group(1))
        for match in CITED_PATH.finditer(text)
    ]


def test_every_cited_path_exists():
    """A path the docs or the package's docstrings give a reader leads to a file: a renamed or
    moved module or test leaves no stale path behind. docs/testing.md's table of tests names them
    from ``tests/`` (``experiments/test_rounding.py``), which counts too there."""
    stale = []
    for path in PATH_CITING:
        for line, cited in cited_paths(path.read_text()):
            found = (REPO / cited).is_file() or (
                path.name == "testing.md" and (REPO / "tests" / cited).is_file()
            )
            if not found:
                stale.append(f"{path.relative_to(REPO)}:{line}: {cited}")
    assert not stale, f"paths that lead to no file: {stale}"


def test_a_stale_path_is_found():
    text = "see `tests/test_gather.py`,\n(src/gatherlab/runs/record.py), experiments/<name>.py"
    assert cited_paths(text) == [(1, "tests/test_gather.py"), (2, "src/gatherlab/runs/record.py")]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text without Markdown marks, lowercase, punctuation but
    '-' and '_' removed, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced blocks), repeated ones numbered
    as GitHub numbers them, and its explicit ``<a id=...>``/``<a name=...>``."""
    text = FENCE.sub("", path.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE):
        slug = anchor(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def test_the_anchor_rule_is_githubs():
    assert anchor("7. Real optimizers: when a wrong gradient matters") == (
        "7-real-optimizers-when-a-wrong-gradient-matters"
    )
    assert anchor("Weights & Biases") == "weights--biases"
    assert anchor("Classification thresholds (the gradient audit)") == (
        "classification-thresholds-the-gradient-audit"
    )
    assert anchor("The `check` at work") == "the-check-at-work"


def test_every_link_finds_its_file_and_heading():
    broken = []
    for path in MARKDOWN:
        text = FENCE.sub("", path.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, f"links that lead nowhere: {broken}"


def test_contract_section_5_names_every_run_file_and_column():
    """The files, columns and verdicts of ``core.runfiles`` and ``terms.RunVerdict``, which eight
    modules cite as "docs/contract.md §5", are all in that section."""
    text = DESIGN["contract"].read_text()
    section = text[text.index("\n## 5. ") :]
    names = (
        runfiles.CURVES, runfiles.SUMMARY, runfiles.FINAL_STATE, runfiles.LOCK,
        runfiles.COMPARISON, runfiles.AUDIT, runfiles.CHECK, runfiles.SCALING,
        *runfiles.CURVE_COLUMNS, *runfiles.SUMMARY_COLUMNS, *terms.RunVerdict,
    )  # fmt: skip
    # what the section writes as code: `curves.csv`, `step, loss, grad_norm`, `no reference`, ...
    spans = re.findall(r"`([^`]+)`", FENCE.sub("", section))
    named = set(spans) | {word for span in spans for word in re.split(r"[,\s]+", span)}
    missing = [name for name in names if name not in named]
    assert not missing, f"docs/contract.md §5 does not name {missing}"


# --- the examples of the docstrings -------------------------------------------------------------


def docstring_examples() -> list[doctest.DocTest]:
    """Every docstring of the package that holds an example (``>>>``), once each. ``__main__``
    modules are not imported: importing one runs its command."""
    finder = doctest.DocTestFinder()
    found: dict[tuple[str, int | None], doctest.DocTest] = {}
    for info in pkgutil.walk_packages(gatherlab.__path__, "gatherlab."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        for test in finder.find(importlib.import_module(info.name)):
            if test.examples:
                found.setdefault((str(test.filename), test.lineno), test)
    return sorted(found.values(), key=lambda test: test.name)


@pytest.fixture(scope="module")
def examples_directory(pr1531_sweep, tmp_path_factory) -> Path:
    """Where the docstrings' examples run: a directory whose ``multirun/`` holds one finished
    sweep (lightly PR #1531's: ``old`` and ``fixed`` on cpu1 and cpu2), as a user's would."""
    sweep, _ = pr1531_sweep
    directory = tmp_path_factory.mktemp("examples")
    shutil.copytree(sweep, directory / "multirun" / "pr1531")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("example", docstring_examples(), ids=lambda test: test.name)
def test_docstring_example(example: doctest.DocTest, examples_directory, monkeypatch):
    """Each example runs in the directory above and prints what the docstring shows (``...``
    matches any text)."""
    monkeypatch.chdir(examples_directory)
    test = copy.copy(example)
    test.globs = dict(example.globs)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)


def test_a_wrong_example_fails():
    """The runner above fails an example whose output is not what the docstring shows."""

    def shown():
        """>>> 1 + 1
        3
        """

    (test,) = doctest.DocTestFinder().find(shown, "shown", globs={})
    result = doctest.DocTestRunner().run(test, out=lambda text: None)
    assert (result.failed, result.attempted) == (1, 1)


# --- the printed outputs of README.md and docs/usage.md -----------------------------------------


def _examples_module():
    spec = importlib.util.spec_from_file_location("docs_examples", REPO / "docs" / "examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_example_has_its_block():
    examples = _examples_module()
    assert set(examples.committed()) == set(examples.EXAMPLES)
    assert set(CHECKED_EXAMPLES) <= set(examples.EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED_EXAMPLES)
def test_the_committed_output_is_what_the_code_prints(name, tmp_path, monkeypatch):
    """The block of the docs is what its command prints today, run as a user runs it: in an empty
    directory, in a fresh interpreter where stderr is shown (``IN_PROCESS_EXAMPLES``: in this
    process). Run ``make examples`` to regenerate every block."""
    from helpers import run_command

    examples = _examples_module()
    path, committed = examples.committed()[name]
    if name in IN_PROCESS_EXAMPLES:
        example = examples.EXAMPLES[name]
        assert set(example.pythonpath) <= {"examples"}  # on this process's path (pyproject.toml)
        flag, module, *arguments = shlex.split(example.arguments)
        assert (flag, module) == ("-m", "gatherlab.check"), example.arguments
        monkeypatch.chdir(tmp_path)
        done = run_command("check", *arguments)
        printed = examples.block(name, done.stdout, done.stderr, done.returncode)
    else:
        printed = examples.run(name)
    diff = difflib.unified_diff(committed.splitlines(), printed.splitlines(), "docs", "printed")
    assert printed == committed, f"{path}, example {name} (make examples):\n" + "\n".join(diff)


# The sampler recipes of docs/usage.md ("The same global batch at every world size") and the
# bundled job that runs each (tests/journeys/test_jobs.py, test_record_hf.py): what the recipe
# tells a user to write, the job writes.
RECIPES = {
    "lightning_job.py": ("use_distributed_sampler=", "gatherlab.data.LayoutInvariantSampler(",
                         "drop_last=True", "def train_dataloader(self):"),
    "hf_job.py": ("dataloader_drop_last=True", "seed=args.seed", "per_device_train_batch_size=",
                  "gradient_accumulation_steps="),
    "ddp.py": ("common.loader(",),
}  # fmt: skip


def test_each_sampler_recipe_is_what_its_bundled_job_runs():
    usage = (REPO / "docs" / "usage.md").read_text()
    recipes = usage[usage.index("### The same global batch at every world size") :]
    recipes = recipes[: recipes.index("\n## ")] if "\n## " in recipes else recipes
    for job, lines in RECIPES.items():
        assert f"examples/jobs/{job}" in recipes, job
        source = (REPO / "examples" / "jobs" / job).read_text()
        for line in lines:
            assert line in source, (job, line)
    common = (REPO / "examples" / "jobs" / "common.py").read_text()
    assert "gatherlab.data.LayoutInvariantSampler(dataset, args.global_batch, seed=args.seed)" in (
        common
    )
    for words in ("use_distributed_sampler=False", "dataloader_drop_last=True",
                  "LayoutInvariantSampler(dataset, global_batch_size"):  # fmt: skip
        assert words in " ".join(recipes.split()), words


def test_the_readmes_numbers_at_real_sizes_are_the_size_benchmarks():
    """README.md's "At real sizes" says what `gatherlab.lab.sizes.summary` reads from the size
    benchmark's table beside its figure (figures/size_cost.csv), which ``python -m gatherlab.bench
    size --out figures/size_cost`` writes and prints: a new run, or a sentence edited by hand,
    that does not match fails here."""
    import pandas as pd

    from gatherlab.lab import sizes

    readme = " ".join((REPO / "README.md").read_text().split())
    said = sizes.summary(pd.read_csv(REPO / "figures" / "size_cost.csv"))
    assert f"**At real sizes.** {said}" in readme, said


def test_import_gatherlab_alone_reaches_every_module_the_docs_write_as_its_attribute():
    """The docs write ``gatherlab.data.LayoutInvariantSampler(...)``, ``gatherlab.record(...)``,
    ``gatherlab.check.check_loss(...)`` after ``import gatherlab``: each is imported when first
    reached (the package's ``__getattr__``, called here directly, since this process has imported
    them all already). A user's Lightning job met ``module 'gatherlab' has no attribute 'data'``."""
    import gatherlab

    for name in ("data", "record", "compare", "check", "testing", "gather", "losses"):
        assert gatherlab.__getattr__(name) is importlib.import_module(f"gatherlab.{name}"), name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        gatherlab.__getattr__("nothing")
