"""The printed outputs in README.md and docs/usage.md, generated from real runs (``make examples``).

Each generated block in those files is a fenced block between two HTML comments, which GitHub does
not show::

    <!-- example: NAME -->
    ```
    ...what the command printed...
    ```
    <!-- /example -->

``EXAMPLES`` says which command makes each NAME and which part of what it prints the block holds.
``python docs/examples.py`` runs every example and rewrites its block; ``--check`` writes nothing
and exits with status 1 when a committed block is not what the code prints today (a unified diff
per block); names choose examples (``python docs/examples.py --check bad_value plain_step``, what
tests/journeys/test_docs.py runs). An example missing from the docs, or a marker naming no
example, is an error.

What varies from one run to the next is normalised in one way, ``normalise``: every command runs
in a fresh temporary directory (so the paths it prints are relative to it), and the dates and times
that name run directories (``2026-12-01``, ``05-19-34-572445``) become ``<date>`` and ``<time>``.
Timings are never part of a block. The numbers are those of this machine: a difference at float64
rounding (1e-16) may print another last digit elsewhere, which is why the suite checks only blocks
without such numbers.

It lives beside the files it writes (docs/), not in experiments/, whose scripts regenerate figures
and tables of results.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "README.md", REPO / "docs" / "usage.md")
# A block may be indented (inside a list item): its every line by the marker's indent.
BLOCK = re.compile(
    r"^(?P<indent> *)<!-- example: (?P<name>[a-z0-9_]+) -->\n"
    r"(?P=indent)```\n(?P<text>.*?)^(?P=indent)```\n(?P=indent)<!-- /example -->",
    re.DOTALL | re.MULTILINE,
)
MARKER = re.compile(r"<!-- example: ([a-z0-9_]+) -->")


@dataclass(frozen=True)
class Example:
    """A command and what its block shows.

    ``arguments`` follow ``python``, as the shell would split them; ``pythonpath`` are folders of
    the repository put on PYTHONPATH (and shown before the command). ``shows``: ``stdout`` or
    ``stderr`` whole, or ``comparison`` (the comparison table a sweep prints, from its ``run``
    header to its last row), ``table`` (the first Markdown table on stdout) or
    ``without_updates`` (a comparison's stdout without its departing update's table).
    ``prompt``: the block starts with the command after ``$``. ``status``: the block ends with
    ``$ echo $?`` and the exit status. ``before``: Python run first, with the same PYTHONPATH
    (e.g. a download)."""

    arguments: str
    shows: str = "stdout"
    pythonpath: tuple[str, ...] = ()
    prompt: bool = True
    status: bool = False
    before: str | None = None

    def command_line(self) -> str:
        """``$ [PYTHONPATH=...] python ARGUMENTS``, continued with ``\\`` past 100 columns."""
        words = [f"PYTHONPATH={':'.join(self.pythonpath)}"] if self.pythonpath else []
        words.append("python")
        for argument in map(
            shlex.quote, shlex.split(self.arguments)
        ):  # an option stays with its value
            if words[-1].startswith("--") and " " not in words[-1] and argument[0] != "-":
                words[-1] += " " + argument
            else:
                words.append(argument)
        lines = ["$"]
        for word in words:
            if len(lines[-1]) + 1 + len(word) > 96:
                lines[-1] += " \\"
                lines.append("     ")
            lines[-1] += " " + word
        return "\n".join(lines)


CHECK = "-m gatherlab.check"
OPENCLIP = f"""{CHECK} public_code:OpenClipForCheck --kwargs '{{"learn_logit_scale": true}}'"""
# OpenCLIP's released loss.py, fetched once into the cache as experiments/public_code.py fetches it
FETCH_OPENCLIP = (
    "from public_code import *; r = ('open-clip-torch', OPEN_CLIP); "
    "(release_root(*r) / OPEN_CLIP_FILES[0]).is_file() or unpack(download(*r), *r, OPEN_CLIP_FILES)"
)


def record_job(bug: str) -> str:
    """The bundled DDP job recorded on one device (no process group) and under torchrun at W = 4,
    into ``runs/one`` and ``runs/four``, as the docs' commands record it."""
    return (
        "import subprocess, sys; "
        f"job = [{str(REPO / 'examples' / 'jobs' / 'ddp.py')!r}, '--bug', {bug!r}]; "
        "quiet = {'check': True, 'stdout': subprocess.DEVNULL}; "
        "subprocess.run([sys.executable, job[0], '--record', 'runs/one', *job[1:]], **quiet); "
        "subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '4', "
        "job[0], '--record', 'runs/four', *job[1:]], **quiet)"
    )


# name → the arguments after ``python`` (split as the shell splits them) and what the block shows
EXAMPLES = {
    # README, journey 1 (make demo)
    "bug_demo": Example("-m gatherlab.train -m experiment=bug_demo", "comparison", prompt=False),
    # README, journey 3
    "own_sweep": Example(
        "-m gatherlab.train -m gather=old,fixed layout=cpu1,cpu2,cpu4 loss=ntxent_global "
        "steps=30 optim.lr=0.1",
        "comparison",
        prompt=False,
    ),
    # README, journey 2: the table only
    "openclip_table": Example(
        f"{OPENCLIP} --world-sizes 2,4", "table", ("experiments",), before=FETCH_OPENCLIP
    ),
    # docs/usage.md, the check at work
    "openclip": Example(
        f"{OPENCLIP} --world-sizes 2,4 --steps 20",
        pythonpath=("experiments",),
        status=True,
        before=FETCH_OPENCLIP,
    ),
    "scaled": Example(
        f"{CHECK} diagnosis_cases:ScaledToUndoAverage --world-sizes 2,4 --steps 20",
        "table",
        ("examples",),
    ),
    "module": Example(
        f"{CHECK} --module ssl_modules:SimCLRWithBatchNorm --data ssl_modules:AugmentedGaussians "
        "--world-sizes 2,4 --steps 20",
        pythonpath=("examples",),
    ),
    "plain_step": Example(
        f"{CHECK} --step plain_steps:augmenting_step --model plain_steps:build_model "
        "--data plain_steps:Points --world-sizes 2,4 --steps 20",
        pythonpath=("examples",),
    ),
    "update": Example(
        f"{CHECK} --update updates:naive --model plain_steps:build_model --data plain_steps:Pairs "
        "--world-sizes 1,2 --micro-batches 1,2 --steps 5 --global-batch-size 16",
        pythonpath=("examples",),
        status=True,
    ),
    "tensor_parallel": Example(
        f"{CHECK} --step tp_steps:cosine_step --model tp_steps:build --data tp_steps:Views "
        "--optimizer tp_steps:local_sgd --tensor-parallel 2 --world-sizes 2,4 --steps 3 "
        "--global-batch-size 8",
        pythonpath=("examples",),
    ),
    "precision": Example(
        f"{CHECK} --step plain_steps:training_step --model precision_cases:build_float32_scale "
        "--data plain_steps:Pairs --world-sizes 2,4 --steps 5 --precision bf16-mixed",
        pythonpath=("examples",),
    ),
    # docs/usage.md, comparing two recordings of your own job
    "compare": Example(
        "-m gatherlab.compare runs/one runs/four",
        status=True,
        before=record_job("temperature-outside"),
    ),
    # README, journey 4
    "compare_journey": Example(
        "-m gatherlab.compare runs/one runs/four",
        "without_updates",
        status=True,
        before=record_job("old-gather"),
    ),
    # docs/usage.md, when things go wrong
    "bad_value": Example("-m gatherlab.train -m layout=cpu1,cpu4 global_batch_size=6", "stderr"),
    "collectives": Example(
        f"{CHECK} collective_cases:GatherOnZeroReduceElsewhere --world-sizes 2,4",
        pythonpath=("examples",),
        status=True,
    ),
}


def normalise(text: str) -> str:
    """The run directories' dates and times as ``<date>`` and ``<time>``."""
    text = re.sub(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)", "<date>", text)
    return re.sub(r"(?<!\d)\d{2}-\d{2}-\d{2}-\d{6}(?!\d)", "<time>", text)


def _comparison(stdout: str) -> str:
    lines = stdout.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    return "".join(lines[start:end])


def _without_updates(stdout: str) -> str:
    """What ``gatherlab.compare`` printed without its table of the departing update (the line
    that introduces it stays: updates.csv has every update)."""
    lines = stdout.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("B departs from A")), None)
    if start is None:
        return stdout
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("|"))
    return "".join(lines[: start + 1] + lines[end:])


def _table(stdout: str) -> str:
    lines = stdout.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[start:end])


def run(name: str) -> str:
    """The block of example ``name``: its command run in a fresh temporary directory."""
    example = EXAMPLES[name]
    paths = [str(REPO / folder) for folder in example.pythonpath]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix=f"example-{name}-") as directory:
        if example.before is not None:
            subprocess.run(
                [sys.executable, "-c", example.before], cwd=directory, env=env, check=True
            )
        done = subprocess.run(
            [sys.executable, *shlex.split(example.arguments)],
            cwd=directory,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    return block(name, done.stdout, done.stderr, done.returncode)


def block(name: str, stdout: str, stderr: str, returncode: int) -> str:
    """The block of example ``name`` from what its command printed and its exit status (``run``
    runs the command; tests/journeys/test_docs.py runs a stdout example in the test process)."""
    example = EXAMPLES[name]
    shown = {
        "stdout": lambda: stdout,
        "stderr": lambda: stderr,
        "comparison": lambda: _comparison(stdout),
        "table": lambda: _table(stdout),
        "without_updates": lambda: _without_updates(stdout),
    }
    try:
        text = shown[example.shows]()
    except StopIteration:
        raise RuntimeError(
            f"{name}: no {example.shows} in what it printed (exit status {returncode}):\n"
            f"{stdout}{stderr[-3000:]}"
        ) from None
    if example.prompt:
        text = f"{example.command_line()}\n{text}"
    if example.status:
        text += f"$ echo $?\n{returncode}\n"
    return normalise(text)


def committed() -> dict[str, tuple[Path, str]]:
    """Each example's block as the docs hold it: name → (file, text)."""
    found: dict[str, tuple[Path, str]] = {}
    for path in DOCS:
        content = path.read_text()
        for match in BLOCK.finditer(content):
            name = match["name"]
            if name not in EXAMPLES:
                raise SystemExit(f"{path}: the marker of {name!r} names no example of EXAMPLES")
            if name in found:
                raise SystemExit(f"{path}: example {name!r} is in the docs twice")
            found[name] = (path, _dedent(match["text"], match["indent"]))
        unclosed = set(MARKER.findall(content)) - {m["name"] for m in BLOCK.finditer(content)}
        if unclosed:
            raise SystemExit(f"{path}: markers without a fenced block and its end: {unclosed}")
    missing = set(EXAMPLES) - set(found)
    if missing:
        raise SystemExit(f"examples without a block in {[str(p) for p in DOCS]}: {missing}")
    return found


def _dedent(text: str, indent: str) -> str:
    return "".join(line.removeprefix(indent) for line in text.splitlines(keepends=True))


def write(path: Path, name: str, text: str) -> None:
    """Replace the block of ``name`` in ``path`` by ``text``."""
    content = path.read_text()

    def replaced(match: re.Match) -> str:
        if match["name"] != name:
            return match[0]
        indent = match["indent"]
        body = "".join(indent + line if line.strip() else line for line in text.splitlines(True))
        fence = f"{indent}```\n"
        return f"{indent}<!-- example: {name} -->\n{fence}{body}{fence}{indent}<!-- /example -->"

    path.write_text(BLOCK.sub(replaced, content))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"examples to run (default: all): {list(EXAMPLES)}"
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a block is stale"
    )
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(EXAMPLES)
    if unknown:
        parser.error(f"unknown examples {sorted(unknown)}; allowed: {', '.join(EXAMPLES)}")
    blocks = committed()
    stale = 0
    for name in args.names or list(EXAMPLES):
        path, old = blocks[name]
        new = run(name)
        if new == old:
            print(f"{name}: current ({path.relative_to(REPO)})")
            continue
        stale += 1
        if args.check:
            diff = difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True),
                f"{path.relative_to(REPO)} ({name}, committed)", f"{name} (printed today)",
            )  # fmt: skip
            print("".join(diff))
        else:
            write(path, name, new)
            print(f"{name}: rewritten ({path.relative_to(REPO)})")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
