"""``python -m gatherlab.compare A B`` as a user runs it, on recordings of plain loops
(``recorded_jobs``) made by `gatherlab.record.Recorder`: exit status 0 for a run that trains like
its reference, 1 for one that does not, and 2 with one line for each bad input (recordings of
different models, of different settings that must agree, a truncated file, a newer format, a
directory that is no recording, an ``--out`` that holds a comparison)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import pythonpath, run_command
from recorded import record_cases

pytestmark = pytest.mark.slow

PREFIX = "gatherlab.compare: error: "
TRAIN = "recorded_jobs:train"


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("recordings")
    return record_cases(root, {
        "w1": (1, TRAIN, {}),
        "w2": (2, TRAIN, {}),
        "half2": (2, TRAIN, {"divide_gradients": True}),
        "torch1": (1, TRAIN, {"sampler": "torch"}),
        "torch2": (2, TRAIN, {"sampler": "torch"}),
        "batchnorm": (1, TRAIN, {"model_kwargs": {"batchnorm": True}}),
        "lr": (1, TRAIN, {"lr": 0.02}),
        "steps": (1, TRAIN, {"steps": 3}),
        "seed": (1, TRAIN, {"seed": 1}),
    })  # fmt: skip


def one_line(finished) -> str:
    """The command's only line on stderr (its error), checked to be one."""
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and finished.returncode == 2, finished
    assert lines[0].startswith(PREFIX), lines
    return lines[0]


@pytest.mark.parametrize(
    ("run", "status", "verdict"),
    [("w2", 0, "exact"), ("half2", 1, "1/W"), ("torch2", 1, "data differs")],
)
def test_the_exit_status_is_the_verdicts(recordings, tmp_path, run, status, verdict):
    reference = "torch1" if run == "torch2" else "w1"
    finished = run_command("compare", str(recordings[reference]), str(recordings[run]),
                           "--out", str(tmp_path / "out"))  # fmt: skip
    assert finished.returncode == status, finished
    assert f"| {verdict} |" in finished.stdout, finished.stdout
    assert {"check.csv", "updates.csv", "compare.png", "compare.pdf"} <= {
        p.name for p in (tmp_path / "out").iterdir()
    }


def test_different_models_are_one_line(recordings):
    finished = run_command("compare", str(recordings["w1"]), str(recordings["batchnorm"]))
    assert one_line(finished) == (
        PREFIX + "A and B record different models: B has parameter 1.1.weight of shape [32], A "
        "has none"
    )


@pytest.mark.parametrize(
    ("run", "words"),
    [("lr", ("settings param_groups[0].lr is 0.01 in A, 0.02 in B",)),
     ("seed", ("seed is 0 in A, 1 in B",)),
     ("steps", ("different numbers of updates: A 4, B 3",))],
)  # fmt: skip
def test_different_settings_are_one_line_naming_both_values(recordings, run, words):
    line = one_line(run_command("compare", str(recordings["w1"]), str(recordings[run])))
    for word in words:
        assert word in line, line


def _copy(recordings, tmp_path, name="w2"):
    copy = tmp_path / f"{name}-copy"
    shutil.copytree(recordings[name], copy)
    return copy


def test_a_truncated_recording_is_one_line(recordings, tmp_path):
    copy = _copy(recordings, tmp_path)
    updates = copy / "updates.jsonl"
    text = updates.read_text()
    updates.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # half a line
    line = one_line(run_command("compare", str(recordings["w1"]), str(copy)))
    assert str(copy) in line or "updates.jsonl" in line, line


def test_a_newer_format_is_one_line_naming_both_versions(recordings, tmp_path):
    copy = _copy(recordings, tmp_path)
    header = json.loads((copy / "header.json").read_text())
    header["version"] = header["version"] + 1
    (copy / "header.json").write_text(json.dumps(header))
    line = one_line(run_command("compare", str(recordings["w1"]), str(copy)))
    assert str(header["version"]) in line and str(header["version"] - 1) in line, line


def test_a_directory_that_is_no_recording_is_one_line(recordings, tmp_path):
    (tmp_path / "notes.txt").write_text("not a recording")
    line = one_line(run_command("compare", str(tmp_path), str(recordings["w2"])))
    assert str(tmp_path) in line, line
    line = one_line(run_command("compare", str(recordings["w1"]), str(tmp_path / "missing")))
    assert "missing" in line, line


def test_an_out_that_holds_a_comparison_is_refused_in_one_line(recordings, tmp_path):
    out = tmp_path / "out"
    arguments = (str(recordings["w1"]), str(recordings["w2"]), "--out", str(out))
    assert run_command("compare", *arguments).returncode == 0
    written = (out / "check.csv").read_text()
    line = one_line(run_command("compare", *arguments))
    assert line == PREFIX + f"--out {out} already holds a comparison; it is never overwritten"
    assert (out / "check.csv").read_text() == written
    # a file where the directory would go: refused before comparing (was the verdict, then a
    # traceback from mkdir, its files lost); likewise the check's --out
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for place in (notes, notes / "sub"):
        line = one_line(run_command("compare", *arguments[:2], "--out", str(place)))
        refused = f"--out {place}: {notes} is a file; allowed: a directory, new or empty"
        assert line == PREFIX + refused
        checked = run_command("check", "gatherlab.losses:NTXentLoss", "--out", str(place))
        assert checked.returncode == 2, checked.stderr
        assert checked.stderr.splitlines() == [f"gatherlab.check: error: {refused}"]
    assert notes.read_text() == "mine"


def test_without_out_the_files_go_beside_b_and_are_kept_when_there(
    recordings, tmp_path, monkeypatch
):
    """No ``--out``: the files go beside B, named after both recordings; run again, the verdict
    is printed and its exit status returned, and the comparison there is kept, as it says;
    nothing is written into the working directory (an empty one of its own: the repository's
    gets other test processes' files, hypothesis' ``.hypothesis`` among them)."""
    runs = tmp_path / "runs"
    shutil.copytree(recordings["w1"], runs / "one")
    shutil.copytree(recordings["half2"], runs / "two")
    (tmp_path / "working").mkdir()
    monkeypatch.chdir(tmp_path / "working")
    first = run_command("compare", str(runs / "one"), str(runs / "two"))
    out = runs / "two-vs-one"
    assert first.returncode == 1 and (out / "check.csv").exists(), first
    assert first.stdout.rstrip().endswith(
        f"written: {out}/ (check.csv, updates.csv, compare.png, compare.pdf)"
    )
    written = (out / "check.csv").read_text()
    again = run_command("compare", str(runs / "one"), str(runs / "two"))
    assert again.returncode == 1 and "B against A, W = 2: 1/W" in again.stdout, again
    assert again.stdout.rstrip().endswith(
        f"not written: {out}/ holds a comparison already (never overwritten; --out DIR writes "
        "this one elsewhere)"
    )
    assert (out / "check.csv").read_text() == written
    assert os.listdir() == []  # nothing in the working directory
    # B recorded again into its directory: the comparison kept is said to be of earlier ones
    final = runs / "two" / "final.json"
    later = (out / "check.csv").stat().st_mtime + 10
    os.utime(final, (later, later))
    stale = run_command("compare", str(runs / "one"), str(runs / "two"))
    assert stale.stdout.rstrip().endswith(
        f"not written: {out}/ holds a comparison of earlier recordings (a recording's final.json "
        "is newer than its check.csv): its files are not this verdict's; remove it, or --out DIR "
        "writes this one elsewhere"
    ), stale
    assert (out / "check.csv").read_text() == written


@pytest.mark.parametrize(
    ("arguments", "words"),
    [((), "the following arguments are required"), (("a", "b", "--tolerance", "-1"), "-1")],
)
def test_usage_errors_are_one_line(arguments, words):
    assert words in one_line(run_command("compare", *arguments))


def test_the_real_command_runs_in_a_fresh_interpreter(recordings, tmp_path):
    """``python -m gatherlab.compare`` itself, once: the ``-m`` entry point, its exit status as
    a process's and its output, which only a fresh interpreter shows (in process, ``main`` is
    called directly)."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    finished = subprocess.run(
        [sys.executable, "-m", "gatherlab.compare", str(recordings["w1"]), str(recordings["half2"]),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 1, finished.stderr
    assert "B against A, W = 2: 1/W" in finished.stdout and not finished.stderr.strip()
    assert (tmp_path / "out" / "updates.csv").exists()


def test_no_figure_writes_the_two_tables_alone_and_prints_the_same(recordings, tmp_path):
    """``--no-figure``: ``check.csv`` and ``updates.csv`` as the command writes them with its
    figure, byte for byte, no ``compare.png``/``.pdf``, the same words and exit status, and the
    files it wrote named."""
    arguments = (str(recordings["w1"]), str(recordings["half2"]))
    full = run_command("compare", *arguments, "--out", str(tmp_path / "full"))
    bare = run_command("compare", *arguments, "--out", str(tmp_path / "bare"), "--no-figure")
    assert bare.returncode == full.returncode == 1, bare
    assert {p.name for p in (tmp_path / "bare").iterdir()} == {"check.csv", "updates.csv"}
    for name in ("check.csv", "updates.csv"):
        assert (tmp_path / "bare" / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    words, said = bare.stdout.rstrip().rsplit("\n", 1)
    assert said == f"written: {tmp_path / 'bare'}/ (check.csv, updates.csv)"
    assert full.stdout.rstrip().rsplit("\n", 1)[0] == words


def test_a_comparison_imports_matplotlib_only_to_draw_and_never_the_tensor_parallel_modules(
    recordings, tmp_path
):
    """In a fresh interpreter: comparing and writing the tables import neither matplotlib
    (~0.4 s, imported to draw the figure) nor torch.distributed.tensor (~0.6 s, the tensor-parallel
    check's); drawing the figure imports matplotlib (docs/performance.md, "Comparing two
    recordings: its time")."""
    a, b = str(recordings["w1"]), str(recordings["w2"])
    code = (
        "import sys\n"
        "import gatherlab.compare as c\n"
        "heavy = ('matplotlib', 'torch.distributed.tensor')\n"
        f"c.compare({a!r}, {b!r}, out={str(tmp_path / 'bare')!r}, figure=False)\n"
        "print(*[name for name in heavy if name in sys.modules])\n"
        f"c.compare({a!r}, {b!r}, out={str(tmp_path / 'full')!r})\n"
        "print(*[name for name in heavy if name in sys.modules])\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines() == ["", "matplotlib"]


def test_the_commands_exit_runs_atexit_flushes_its_streams_and_keeps_its_status(tmp_path):
    """`gatherlab.core.cli.exit_now`, the command's end without the interpreter's teardown: the
    process's ``atexit`` handlers ran (one writes a file), what it printed, held in the stream's
    buffer (1,000 characters, no newline, into a pipe), reaches the pipe whole, and the exit status
    is the one given."""
    code = (
        "import atexit, pathlib, sys\n"
        "from gatherlab.core import cli\n"
        f"atexit.register(pathlib.Path({str(tmp_path / 'ran')!r}).write_text, 'yes')\n"
        "print('x' * 1000, end='')\n"
        "print('last', end='', file=sys.stderr)\n"
        "cli.exit_now(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    env.pop("PYTHONUNBUFFERED", None)  # the streams buffered, as a user's shell has them
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
    assert finished.returncode == 3, finished.stderr
    assert finished.stdout == "x" * 1000 and finished.stderr == "last"
    assert (tmp_path / "ran").read_text() == "yes"


def test_ctrl_c_is_one_line_and_exit_status_130(recordings, monkeypatch, tmp_path):
    """Ctrl-C while the recordings are compared (a KeyboardInterrupt where the work is done):
    one line on stderr, no traceback, status 130, nothing written."""
    import gatherlab.compare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gatherlab.compare, "_compare", interrupted)
    out = tmp_path / "out"
    finished = run_command("compare", str(recordings["w1"]), str(recordings["w2"]), "--out",
                           str(out))  # fmt: skip
    assert finished.returncode == 130 and not finished.stdout
    assert finished.stderr == "gatherlab.compare: interrupted; nothing was written\n"
    assert not out.exists()
