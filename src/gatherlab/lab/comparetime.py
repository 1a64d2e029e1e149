"""``python -m gatherlab.bench compare``: a comparison of two recordings as a user runs it,
``python -m gatherlab.compare A B`` from a fresh shell, timed (docs/performance.md, "Comparing two
recordings: its time").

The recordings are made once, into a temporary directory: the bundled DDP job
(``examples/jobs/ddp.py``) at its 5 updates and at 100, on one device (A, plain ``python``) and on
2 gloo ranks (B, ``torchrun``); a small bf16 job (`bf16_job`: an MLP under CPU bf16 autocast, DDP,
SGD) on one device (A), its floor (C: the same command with ``GATHERLAB_RECORD_FLOOR``) and on 2
ranks (B). Then, ``repeats`` times, each case's command in a fresh interpreter, in turns with
``python -c "import torch"`` (what any command that imports torch costs, its interpreter's
teardown included, which the command skips: `gatherlab.core.cli.exit_now`), with the command at
``--no-figure``, given ``baseline`` (another source tree, e.g. main's ``src``) with that tree's
command, and with the phases' program (`PHASES_PROGRAM`): every variant in one round, which goes
first turning round by round. Printed per case: each variant's median seconds, when the
verdict's line came (median), its ratio to ``import torch`` and to the baseline (medians of the
rounds' ratios), the goal (`GOALS`) met or not at the load, and the command's phases, timed
inside a fresh interpreter that does what the command does, step by step: the interpreter's
start, importing torch, importing the rest (pandas, the judge), reading the recordings, judging,
writing the two tables, importing matplotlib, drawing and saving the figure, the exit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("start", "import torch", "import the rest", "read", "judge", "tables",
          "import matplotlib", "figure", "exit")  # fmt: skip
"""The phases of a comparison as `PHASES_PROGRAM` times them, in order."""
GOALS = {"ddp, 5 updates": 3.0, "ddp, 100 updates": 3.0, "bf16, with its floor": 6.0}
"""The seconds each case's command should take from a fresh shell (the bf16 pair's with its floor
recording)."""
BF16_FEATURES, BF16_HIDDEN, BF16_OUTPUTS, BF16_BATCH, BF16_UPDATES = 16, 64, 8, 32, 5


def bf16_job(out: str, updates: int = BF16_UPDATES) -> None:
    """A small job in bf16 autocast on one device or on each rank torchrun starts (gloo): an MLP
    (16 → 64 → 8, tanh) regressing fixed targets (mean squared error), DDP on W ranks, SGD; rank
    r takes the r-th consecutive rows of the same global batch of 32, so that W ranks train as
    one device does to bf16's rounding. Recorded with ``gatherlab.record`` (`Recorder`); with
    ``GATHERLAB_RECORD_FLOOR`` set on one device, its floor is recorded."""
    import torch
    import torch.distributed as dist

    from gatherlab.recording.recorder import Recorder  # gatherlab.record(...)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun's ranks
    if distributed:
        dist.init_process_group("gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BF16_FEATURES, BF16_HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(BF16_HIDDEN, BF16_OUTPUTS))  # fmt: skip
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    criterion = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(updates, BF16_BATCH, BF16_FEATURES, generator=generator)
    targets = torch.randn(updates, BF16_BATCH, BF16_OUTPUTS, generator=generator)
    rows = slice(rank * BF16_BATCH // world, (rank + 1) * BF16_BATCH // world)
    with Recorder(model, optimizer, out, loss=criterion, seed=0):
        for update in range(updates):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(wrapped(inputs[update, rows]), targets[update, rows])
            loss.backward()
            optimizer.step()
    if distributed:
        dist.destroy_process_group()


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    finished = subprocess.run(command, capture_output=True, text=True, env=env)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{finished.stderr[-2000:]}")


def _environment(source: Path, **more: str) -> dict[str, str]:
    """This process's environment with ``source`` (a tree's ``src``) first on the path."""
    return {**os.environ, "PYTHONPATH": str(source), **more}


def make_recordings(root: Path, source: Path) -> dict[str, tuple[Path, Path, Path | None]]:
    """The cases' recordings (A, B, floor or None) made into ``root`` by ``source``'s gatherlab:
    ``ddp, 5 updates``, ``ddp, 100 updates`` and ``bf16, with its floor``."""
    jobs = Path(__file__).resolve().parents[3] / "examples" / "jobs"
    if not (jobs / "ddp.py").exists():
        raise FileNotFoundError(f"{jobs / 'ddp.py'}: the bench compare runs from a checkout")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    environment = _environment(source)
    cases: dict[str, tuple[Path, Path, Path | None]] = {}
    for steps in (5, 100):
        one, two = root / f"ddp{steps}-one", root / f"ddp{steps}-two"
        _run([sys.executable, str(jobs / "ddp.py"), "--steps", str(steps), "--record", str(one)],
             environment)  # fmt: skip
        _run([*torchrun, str(jobs / "ddp.py"), "--steps", str(steps), "--record", str(two)],
             environment)  # fmt: skip
        cases[f"ddp, {steps} updates"] = (one, two, None)
    one, floor, two = root / "bf16-one", root / "bf16-one-floor", root / "bf16-two"

    def job(out: Path) -> list[str]:
        code = f"from gatherlab.lab.comparetime import bf16_job; bf16_job({str(out)!r})"
        return [sys.executable, "-c", code]

    _run(job(one), environment)
    _run(job(one), _environment(source, GATHERLAB_RECORD_FLOOR=str(floor)))
    _run([*torchrun, "--no-python", *job(two)], environment)
    cases["bf16, with its floor"] = (one, two, floor)
    return cases


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """``command``'s wall time from its start to its end, and to its first line on stdout (the
    verdict's words come first); its stdout."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)  # fmt: skip
    assert process.stdout is not None
    first = process.stdout.readline()
    first_time = time.perf_counter() - start
    rest = process.stdout.read()  # through the same buffer as the first line (not communicate's)
    errors = process.stderr.read() if process.stderr else ""
    process.wait()
    total = time.perf_counter() - start
    if process.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(command)}: exit {process.returncode}\n{errors[-2000:]}")
    return total, first_time, first + rest


PHASES_PROGRAM = """
import itertools, json, sys, time
from pathlib import Path
marks = [time.time()]  # the program's first line
import torch
marks.append(time.time())
from gatherlab import compare
from gatherlab.check.recordings import compare_recordings
from gatherlab.core import cli
from gatherlab.recording import format as recording_format
marks.append(time.time())
reference, run, floor, out = sys.argv[1:]
recordings = [recording_format.read(path) for path in (reference, run, floor) if path]
marks.append(time.time())
comparison = compare_recordings(recordings[0], recordings[1],
                                floor=recordings[2] if floor else None)
print(comparison.words, flush=True)
marks.append(time.time())
compare.write(comparison, Path(out) / "tables", figure=False)
marks.append(time.time())
from gatherlab.analysis import figures
marks.append(time.time())
compare.write(comparison, Path(out) / "figure")
end = time.time()
marks.append(end - (marks[5] - marks[4]))  # the figure's writing less the tables' again
print(json.dumps({"started": marks[0], "end": end,
                  "steps": [b - a for a, b in itertools.pairwise(marks)]}))
cli.exit_now(0)
"""
"""The command's steps, each timed, in a fresh interpreter (``python -c``, a user's script of the
public API: ``gatherlab.compare.write``, `gatherlab.check.recordings.compare_recordings`): the
figure is drawn into ``out/figure`` after the tables were written into ``out/tables``, its time
that writing's less the tables'. It prints one line of JSON last: its first mark, its end and the
steps' seconds (`PHASES` less the start and the exit)."""


def _phases_of(command_env: dict[str, str], case: tuple[Path, Path, Path | None],
               out: Path) -> dict[str, float]:  # fmt: skip
    """`PHASES_PROGRAM` in a fresh interpreter, with its start and exit from this process's
    clock."""
    reference, run, floor = case
    arguments = [str(reference), str(run), str(floor) if floor else "", str(out)]
    begun = time.time()
    finished = subprocess.run([sys.executable, "-c", PHASES_PROGRAM, *arguments],
                              capture_output=True, text=True, env=command_env)  # fmt: skip
    ended = time.time()
    if finished.returncode != 0:
        raise RuntimeError(f"phases: {finished.stderr[-2000:]}")
    measured = json.loads(finished.stdout.strip().splitlines()[-1])
    steps = dict(zip(PHASES[1:-1], measured["steps"], strict=True))
    return {"start": measured["started"] - begun, **steps, "exit": ended - measured["end"]}


def run(repeats: int, baseline: Path | None) -> dict[str, dict[str, float]]:
    """Make the recordings, time every case's variants in turns and its phases; print and return
    each case's medians (seconds)."""
    import tempfile

    import gatherlab

    source = Path(gatherlab.__file__).resolve().parents[1]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-compare-") as directory:
        root = Path(directory)
        made = time.perf_counter()
        cases = make_recordings(root / "recordings", source)
        print(f"recordings made in {time.perf_counter() - made:.0f} s (torch "
              f"{_torch_version()}, {os.cpu_count()} CPUs; load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())})")  # fmt: skip
        for name, case in cases.items():
            results[name] = _case(name, case, repeats, source, baseline, root / "out")
        print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return results


def _torch_version() -> str:
    import torch

    return torch.__version__


def _verdict(words: str) -> str:
    """The verdict of a comparison's words: the column ``verdict`` of its table's first row."""
    lines = words.splitlines()
    for at, line in enumerate(lines):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if "verdict" in cells and at + 2 < len(lines):
            return [cell.strip() for cell in lines[at + 2].strip("|").split("|")][
                cells.index("verdict")
            ]
    return "?"


def _case(name: str, case: tuple[Path, Path, Path | None], repeats: int, source: Path,
          baseline: Path | None, out: Path) -> dict[str, float]:  # fmt: skip
    """One case's variants timed in turns, ``repeats`` rounds, and its phases; printed."""
    reference, run, floor = case
    arguments = [str(reference), str(run), *(["--floor", str(floor)] if floor else [])]
    command = [sys.executable, "-m", "gatherlab.compare", *arguments]
    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        "import torch": ([sys.executable, "-c", "import torch"], _environment(source)),
        "compare": (command, _environment(source)),
        "compare --no-figure": ([*command, "--no-figure"], _environment(source)),
    }
    if baseline is not None:
        variants[f"compare ({baseline})"] = (command, _environment(baseline))
    totals, verdicts, said, samples = _rounds(name, case, variants, repeats, source, out)
    return _report(name, case, repeats, baseline, totals, verdicts, said, samples)


def _rounds(name: str, case: tuple[Path, Path, Path | None],
            variants: dict[str, tuple[list[str], dict[str, str]]], repeats: int, source: Path,
            out: Path) -> tuple[dict, dict, dict, list]:  # fmt: skip
    """``repeats`` rounds of every variant and of the phases, in an order that turns each round:
    each variant's times, when its verdict came and its first output, and the phases' samples."""
    totals: dict[str, list[float]] = {variant: [] for variant in variants}
    verdicts: dict[str, list[float]] = {variant: [] for variant in variants}
    said: dict[str, str] = {}
    samples: list[dict[str, float]] = []
    runs = 0
    for repeat in range(repeats):
        order = [*variants, "phases"]
        order = order[repeat % len(order) :] + order[: repeat % len(order)]
        for variant in order:
            if variant == "phases":  # in the same rounds, under the same load
                samples.append(_phases_of(_environment(source), case, out / f"{name}-p{repeat}"))
                continue
            argv, env = variants[variant]
            if variant.startswith("compare"):
                runs += 1
                argv = [*argv, "--out", str(out / f"{name}-{runs}")]
            total, first, stdout = _timed(argv, env)
            totals[variant].append(total)
            verdicts[variant].append(first)
            said.setdefault(variant, stdout)
    return totals, verdicts, said, samples


def _report(name: str, case: tuple[Path, Path, Path | None], repeats: int,
            baseline: Path | None, totals: dict, verdicts: dict, said: dict,
            samples: list) -> dict[str, float]:  # fmt: skip
    """A case's rounds printed: each variant's median and its ratio to ``import torch``, the
    baseline's ratio, the goal, and the phases; its medians returned."""
    reference, run, floor = case
    medians = {variant: statistics.median(times) for variant, times in totals.items()}
    print(f"\n{name}: {reference.name} vs {run.name}" + (f", floor {floor.name}" if floor else ""))
    words = {variant: text.rsplit("written:", 1)[0] for variant, text in said.items()}
    same = all(text == words["compare"] for key, text in words.items() if key != "import torch")
    print(f"  verdict: {_verdict(said['compare'])}; every command's words the same: {same}")
    torch_times = totals["import torch"]
    for variant, median in medians.items():
        if variant == "import torch":
            print(f"  {variant:<40} {median:6.2f} s (median of {repeats})")
            continue
        seen = statistics.median(verdicts[variant])
        ratio = statistics.median(t / f for t, f in zip(totals[variant], torch_times, strict=True))
        print(f"  {variant:<40} {median:6.2f} s (median of {repeats}), verdict printed at "
              f"{seen:.2f} s; {ratio:.2f} × import torch (the rounds' ratios' median)")  # fmt: skip
    if baseline is not None:
        base = totals[f"compare ({baseline})"]
        for variant in ("compare", "compare --no-figure"):
            ratio = statistics.median(t / b for t, b in zip(totals[variant], base, strict=True))
            print(f"  {variant} / the baseline's: {ratio:.2f} (median of the rounds' ratios)")
    goal = GOALS.get(name)
    if goal is not None:
        print(f"  goal ≤ {goal:g} s: compare {medians['compare']:.2f} s "
              f"{'met' if medians['compare'] <= goal else 'not met'}, --no-figure "
              f"{medians['compare --no-figure']:.2f} s "
              f"{'met' if medians['compare --no-figure'] <= goal else 'not met'} "
              f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    phase = {key: statistics.median(sample[key] for sample in samples) for key in PHASES}
    whole = sum(phase.values())
    print("  phases (medians of " + str(repeats) + ", fresh interpreters in the same rounds): "
          + ", ".join(f"{key} {value:.2f}" for key, value in phase.items())
          + f"; sum {whole:.2f} s")  # fmt: skip
    largest = max(phase, key=phase.__getitem__)
    print(f"  largest: {largest} ({phase[largest] / whole:.0%}); the figure (matplotlib imported, "
          f"drawn, saved) {(phase['import matplotlib'] + phase['figure']) / whole:.0%}; "
          f"imports {(phase['import torch'] + phase['import the rest']) / whole:.0%}; "
          f"reading and judging {(phase['read'] + phase['judge']) / whole:.0%}")  # fmt: skip
    return medians | {f"phase {key}": value for key, value in phase.items()}
