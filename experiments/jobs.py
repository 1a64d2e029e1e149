"""The bundled jobs' whole matrix: every job of ``examples/jobs/`` × W ∈ {1, 2, 4} under torchrun
on CPU gloo × every variant of the job (its bug switches and ``none``; the sentence-transformers
job's ``VARIANTS``: losses, batch samplers, accumulation, a desync), each recorded with
``gatherlab.record`` and compared with ``gatherlab.compare`` against the job's one-device run
(plain ``python``, no process group) of the variant's reference. Prints the table of verdicts and
writes each job's section of ``docs/jobs.md`` (the other jobs' sections are kept).

    python experiments/jobs.py [--out DIR] [--jobs ddp zero] [--worlds 1 2 4] [--doc docs/jobs.md]

Every switch but ``sampler`` is the identity on one device (a gather, batch norm or division over
one rank), so those share the job's correct one-device run as their reference; ``sampler``'s is
the one-device run with a seeded RandomSampler. Each launch's wall time is in the table: torch's
import on every rank, on this machine's cores.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from gatherlab.ranks.ports import unclaimed_port

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "examples" / "jobs"
NAMES = ("ddp", "lightning_job", "fsdp2", "zero", "st_job", "hf_job", "tp", "pp", "ep", "hf_tp")
FLOOR_BLOCKS = {"pp": 4, "ep": 4, "hf_tp": 4}
"""A job's floor's row blocks where not 2: the pipeline's 4 micro-batches, the most ranks."""
TIMEOUT = 300


def applicable(job: str) -> tuple[str, ...]:
    """The job's ``BUGS``, read from its source (importing it would import Lightning)."""
    tree = ast.parse((JOBS / f"{job}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "BUGS":
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{job}.py defines no BUGS")


def variants(job: str) -> list[tuple[str, list[str], list[str]]]:
    """The job's rows: (name, the W ranks' arguments, its one-device reference's). A job with
    ``VARIANTS`` (the sentence-transformers job; it imports nothing heavy at its top) gives them;
    the others each bug switch, whose reference is the correct one-device run (``sampler``'s with
    one device's own sampler)."""
    if job in ("st_job", "hf_job"):
        import importlib.util

        sys.path.insert(0, str(JOBS))  # hf_job imports st_job's tokenizer

        spec = importlib.util.spec_from_file_location(job, JOBS / f"{job}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return [(name, list(mine), list(theirs))
                for name, (mine, theirs) in module.VARIANTS.items()]  # fmt: skip
    return [(bug, ["--bug", bug], ["--bug", "sampler" if bug == "sampler" else "none"])
            for bug in ("none", *applicable(job))]  # fmt: skip


def launch(
    job: str, world: int | None, arguments: list[str], out: Path, floor: Path | None = None
) -> float:
    """The job recorded into ``out``: plainly (``world`` None) or under torchrun with W ranks;
    its wall time. ``floor``: the one-device command run again with GATHERLAB_RECORD_FLOOR, which
    records the job's floor there (a low precision's judgement, docs/design.md §2)."""
    script = str(JOBS / f"{job}.py")
    command = [sys.executable, script] if world is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-addr", "127.0.0.1", "--master-port", str(unclaimed_port()), script,
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(
        [*command, *arguments, "--record", str(out)], capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1",
             **({"GATHERLAB_RECORD_FLOOR": str(floor),
                 "GATHERLAB_RECORD_FLOOR_BLOCKS": str(FLOOR_BLOCKS.get(job, 2))}
                if floor else {})},
        timeout=TIMEOUT,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"{job} {' '.join(arguments)} at W={world or 'one device'} failed "
                         f"({result.returncode}):\n{result.stderr[-3000:]}")  # fmt: skip
    return seconds


def judged(reference: Path, run: Path, floor: Path | None = None) -> dict[str, str]:
    """The comparison's precision, verdict, first departure, its part's gradient class and the
    cause; in a low precision judged in floors of ``floor``."""
    import gatherlab.compare
    from gatherlab.record import read

    comparison = gatherlab.compare(reference, run, floor=floor)
    row = {"precision": read(reference).precision, "verdict": comparison.verdict, "departs": "",
           "class": "", "cause": ""}  # fmt: skip
    if comparison.data is not None:
        row["cause"] = comparison.data.splitlines()[0]
    if comparison.departure is not None:
        update, part = comparison.departure
        row["departs"] = f"update {update}, {part}"
        parts = comparison.table.set_index("part") if "part" in comparison.table else None
        whole = comparison.table.iloc[0].get("cause", "")
        if parts is not None and part in parts.index:
            row["class"] = str(parts.loc[part, "gradient"])
            cause = parts.loc[part].get("cause", "")
            cause = cause if cause == cause and cause else whole  # the part's, else the whole's
            row["cause"] = row["cause"] or ("" if cause != cause else str(cause))
        else:
            row["class"] = str(comparison.table.iloc[0]["gradient"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "jobs" / stamp)
    parser.add_argument("--jobs", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "jobs.md")
    args = parser.parse_args()
    sections = sections_of(args.doc)
    total = sum(len(args.worlds) * len(variants(job)) for job in args.jobs)
    done = 0
    for job in args.jobs:
        rows, started = [], time.perf_counter()
        references: dict[tuple[str, ...], tuple[Path, float]] = {}
        for name, arguments, reference_arguments in variants(job):
            key = tuple(reference_arguments)
            if key not in references:
                path = args.out / job / f"reference{len(references)}" / "one_device"
                seconds = launch(job, None, reference_arguments, path)
                floor = None
                if read_precision(path) != "64-true":  # its floor, by the same command
                    floor = path.with_name("floor")
                    launch(job, None, reference_arguments, path, floor=floor)
                references[key] = (path, seconds, floor)
            reference, reference_seconds, floor = references[key]
            for world in args.worlds:
                path = args.out / job / name.replace(" ", "").replace(",", "_") / f"w{world}"
                seconds = launch(job, world, arguments, path)
                row = {"job": job, "bug": name, "W": str(world)}
                row |= judged(reference, path, floor)
                row |= {
                    "s (W ranks)": f"{seconds:.1f}",
                    "s (one device)": f"{reference_seconds:.1f}",
                }
                rows.append(row)
                done += 1
                print(f"[{done}/{total}] " + " | ".join(row.values()), flush=True)
        sections[job] = section(job, markdown(rows), time.perf_counter() - started)
        print(sections[job])
    args.doc.write_text(document(sections))
    print(f"written: {args.doc}")


def read_precision(recording: Path) -> str:
    from gatherlab.record import read

    return read(recording).precision


def markdown(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[c].replace("|", "\\|") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


HEADING = "## "


def sections_of(doc: Path) -> dict[str, str]:
    """The jobs' sections of ``doc`` as written before (``## <job>`` to the next), by job."""
    if not doc.exists():
        return {}
    text = doc.read_text()
    found = {}
    for chunk in text.split("\n" + HEADING)[1:]:
        job = chunk.split("\n", 1)[0].strip().strip("`")
        found[job] = HEADING + chunk.rstrip() + "\n"
    return found


def section(job: str, table: str, seconds: float) -> str:
    machine = (f"{os.cpu_count()} cores shared with other work, torch {torch.__version__}, "
               f"Python {platform.python_version()}")  # fmt: skip
    return f"{HEADING}`{job}`\n\nIts rows took {seconds:.0f} s ({machine}).\n\n{table}"


def document(sections: dict[str, str]) -> str:
    ordered = [sections[job] for job in NAMES if job in sections]
    return """# The bundled jobs, every world size and variant

Written by `python experiments/jobs.py` (do not edit by hand; `--jobs` rewrites those jobs'
sections alone): each job of `examples/jobs/` recorded with `gatherlab.record` under `torchrun
--nproc-per-node W` on CPU gloo, at the job's own defaults (the SimCLR jobs and the
tensor-parallel block in float64; the sentence-transformers and Hugging Face jobs in float32, the
trainers' default, their texts padded per device batch; the pipeline and the mixture of experts
in float32, their floors in 4 row blocks), and judged by `gatherlab.compare`
against the job's one-device run (plain `python`, no process group): the correct run, since each
bug switch is the identity on one device, but for the `sampler` switch (one device's seeded
RandomSampler) and the trainer jobs' variants (each variant's own one-device run, accumulating
nothing). A float32 job is judged in floors of its floor, the one-device command run again with
`GATHERLAB_RECORD_FLOOR` (`exact within float32` at most T floors, design §2). `departs`: the
first update and part that depart; `class`: that part's gradient against one device's; `cause`:
what the comparison measured. The last two columns are each launch's wall time, torch imported on
every rank.

""" + "\n".join(ordered)


if __name__ == "__main__":
    main()
