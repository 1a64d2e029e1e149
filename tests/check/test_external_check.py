"""``python -m gatherlab.check ... --launcher external``: the check on the ranks that torchrun or
srun started (docs/checking.md §10), on gloo here, 2 ranks. Its ``check.csv`` equals the pooled
check's (the same global batches, the same summation order on gloo: every word equal, every number
to 1e-12); rank 0 alone prints the table and writes the file; bad input stops every rank with the
same one line and status 2, nothing written.

Every test starts fresh interpreters, and that is the point: torchrun (or srun) starts each rank as
a new process that runs the whole command, which the warm pools never do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from bounds import NUMBERS
from helpers import pythonpath

from gatherlab import check
from gatherlab.core import runfiles
from gatherlab.ranks.ports import unclaimed_port

pytestmark = pytest.mark.slow

ENV = {
    **os.environ,
    "PYTHONPATH": pythonpath(),
}
# the header lines of the tables the two checks print: once, by rank 0
LOSS_HEADER = "| loss | gather | world_size | part |"
TRAINING_HEADER = "| world_size | verdict | culprits |"


def _torchrun(out, *arguments: str, env=ENV) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node 2 -m gatherlab.check ARGUMENTS --launcher external
    --out OUT``, its output captured (a hang fails here, with the ranks' output)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "gatherlab.check", *arguments, "--launcher", "external", "--out", str(out)],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _same_table(external: pd.DataFrame, pooled: pd.DataFrame) -> None:
    """Every word equal, every number within 1e-12 (absent where the other's is)."""
    assert list(external.columns) == list(pooled.columns)
    assert len(external) == len(pooled)
    for column in external.columns:
        if column in NUMBERS:
            mine, theirs = external[column].astype(float), pooled[column].astype(float)
            assert (mine.isna() == theirs.isna()).all(), column
            assert ((mine - theirs).abs().fillna(0) <= 1e-12).all(), (column, mine, theirs)
        else:
            mine = ["" if pd.isna(value) else str(value) for value in external[column]]
            theirs = ["" if pd.isna(value) else str(value) for value in pooled[column]]
            assert mine == theirs, column


def _written_once(out, started: subprocess.CompletedProcess, header: str) -> pd.DataFrame:
    """The one ``check.csv`` (nothing else in ``out``), the table printed once (rank 0 only)."""
    assert [path.name for path in out.iterdir()] == [runfiles.CHECK]
    assert started.stdout.count(header) == 1, started.stdout
    assert started.stdout.count("written: ") == 1
    return pd.read_csv(out / runfiles.CHECK)


@pytest.mark.timeout(300)
def test_torchrun_loss_check_equals_the_pooled_check(tmp_path, no_leftover_processes):
    """Who wrote and logged is recorded in every process (tests/support/who_writes.py): rank 0 wrote
    check.csv once, rank 1 and torchrun nothing, and no gatherlab log line came from rank 1; the
    file's name and content alone would not tell a second writer of the same table."""
    import who_writes

    out = tmp_path / "torchrun"
    loss = "diagnosis_cases:LearntTemperatureOwnSlice"
    started = _torchrun(out, loss, "--steps", "3", env=who_writes.recording(ENV, tmp_path / "who"))
    # biased: both ranks exit 1 (torchrun reports it as its own failure)
    assert started.returncode == 1, started.stdout[-3000:] + started.stderr[-3000:]
    assert "exitcode  : 1" in started.stderr and "exitcode  : 2" not in started.stderr
    table = _written_once(out, started, LOSS_HEADER)
    pooled = check.check_loss(loss, (2,), steps=3).table
    assert table["verdict"].tolist() == ["biased", "1/W", "exact"]
    _same_table(table, pooled.reset_index(drop=True))
    # who wrote: rank 0 check.csv once, nothing else below tmp_path; rank 1 and torchrun nothing
    recorded = who_writes.records(tmp_path / "who")
    written = str((out / runfiles.CHECK).resolve())
    assert who_writes.written(recorded) == [(0, "write_table", written)]
    assert who_writes.opened_below(recorded, tmp_path) == {0: [f"torchrun/{runfiles.CHECK}"]}
    assert set(who_writes.logged(recorded)) <= {0}, who_writes.logged(recorded)


@pytest.mark.timeout(300)
def test_torchrun_plain_step_check_names_batchnorm_like_the_pool(tmp_path, no_leftover_processes):
    """A plain PyTorch step (no Lightning on this path) under torchrun: its table equals the
    pooled check's, the batchnorm removal made on the model in each rank. (The LightningModule
    form runs the same jobs through the same runner, with Lightning's import in every rank, ~10 s
    more: it is checked under torchrun in tests/journeys/test_gpu.py, on NCCL.)"""
    out = tmp_path / "torchrun"
    arguments = {"step": "plain_steps:training_step", "model": "plain_steps:build_model",
                 "model_kwargs": {"batchnorm": True}, "data": "plain_steps:Pairs"}  # fmt: skip
    started = _torchrun(
        out, "--step", arguments["step"], "--model", arguments["model"], "--model-kwargs",
        json.dumps(arguments["model_kwargs"]), "--data", arguments["data"], "--steps", "3",
        "--global-batch-size", "16",
    )  # fmt: skip
    assert started.returncode == 1, started.stdout[-3000:] + started.stderr[-3000:]
    table = _written_once(out, started, TRAINING_HEADER)
    pooled = check.check_training(
        world_sizes=(2,), steps=3, global_batch_size=16, **arguments
    ).table
    assert set(table["culprits"]) == {"batchnorm"}
    _same_table(table, pooled.reset_index(drop=True))


@pytest.mark.timeout(300)
def test_torchrun_sharded_step_names_its_unreduced_part_like_the_pool(
    tmp_path, no_leftover_processes
):
    """A step whose model factory shards it with FSDP2 on the ranks torchrun started, its learnt
    temperature left on the unsharded root (examples/sharded_steps.py): the same table as the
    pooled check's, the part measured on the ranks and named ``unreduced`` (issue 50)."""
    out = tmp_path / "torchrun"
    arguments = {"step": "sharded_steps:temperature_step", "data": "plain_steps:Pairs",
                 "model": "sharded_steps:build_fsdp2_temperature_outside"}  # fmt: skip
    started = _torchrun(
        out, "--step", arguments["step"], "--model", arguments["model"], "--data",
        arguments["data"], "--steps", "2", "--global-batch-size", "16",
    )  # fmt: skip
    assert started.returncode == 1, started.stdout[-3000:] + started.stderr[-3000:]
    table = _written_once(out, started, "| world_size | verdict | cause | culprits |")
    pooled = check.check_training(
        world_sizes=(2,), steps=2, global_batch_size=16, **arguments
    ).table
    whole = table[table["part"] == "all"]
    assert whole[["cause", "culprits"]].values.tolist() == [["unreduced", "unreduced"]]
    _same_table(table, pooled.reset_index(drop=True))


@pytest.mark.timeout(300)
def test_torchrun_names_collectives_that_differ_with_both_call_sites(
    tmp_path, no_leftover_processes
):
    """Rank 0 all-gathers where rank 1 all-reduces (examples/collective_cases.py): under torchrun
    the row names both calls, as on the pool (tests/ranks/test_watched.py), with a collective
    timeout of 10 minutes: the line cannot have come from a timeout."""
    import collective_cases
    from helpers import line_of

    out = tmp_path / "torchrun"
    started = _torchrun(
        out, "collective_cases:GatherOnZeroReduceElsewhere", "--collective-timeout", "600"
    )
    assert started.returncode == 1, started.stdout[-3000:] + started.stderr[-3000:]
    table = _written_once(out, started, "| loss | gather | world_size |")
    gather = line_of(collective_cases, "# enters: GatherOnZeroReduceElsewhere (rank 0)")
    reduce = line_of(collective_cases, "# enters: GatherOnZeroReduceElsewhere (others)")
    assert table["error"].tolist() == [
        f"collectives differ: rank 0 entered all_gather at {gather} ((2, 8, 16) float64); "
        f"rank 1 entered all_reduce at {reduce} ((8, 16) float64)"
    ]
    assert "Every rank must enter the same collectives" in " ".join(started.stdout.split())


def _srun(out, *arguments: str) -> list[subprocess.CompletedProcess]:
    """The two ranks as srun starts them (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR
    and MASTER_PORT given by the user), each rank's status and output its own."""
    port = unclaimed_port()

    def rank_env(rank: int) -> dict[str, str]:
        return {**ENV, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip

    command = [sys.executable, "-m", "gatherlab.check", *arguments, "--launcher", "external",
               "--out", str(out)]  # fmt: skip
    processes = [
        subprocess.Popen(
            command,
            cwd=out.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=rank_env(rank),
        )
        for rank in range(2)
    ]
    finished = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=240)
        finished.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return finished


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (("nopkg.losses:Loss",),
         "gatherlab.check: error: loss nopkg.losses:Loss: cannot import nopkg.losses: "
         "ModuleNotFoundError: No module named 'nopkg'"),
        (("gatherlab.losses:NTXentLoss", "--gather", "fixed", "--world-sizes", "4"),
         "gatherlab.check: error: --world-sizes 4 under srun, which started 2 ranks; allowed: 2, "
         "or no --world-sizes"),
    ],
    ids=["no_module", "world_sizes"],
)  # fmt: skip
def test_srun_bad_input_is_one_line_on_every_rank(arguments, line, tmp_path, no_leftover_processes):
    out = tmp_path / "srun"
    for rank, finished in enumerate(_srun(out, *arguments)):
        assert (finished.returncode, finished.stdout) == (2, ""), (rank, finished)
        assert finished.stderr.splitlines() == [line], (rank, finished.stderr)
    assert not out.exists()


@pytest.mark.timeout(300)
def test_srun_names_the_rank_that_raised_not_the_one_waiting_for_it(
    tmp_path, no_leftover_processes
):
    """Rank 1 raises before the all_reduce that rank 0 enters (examples/collective_cases.py): the
    row names rank 1 by its own error, with a collective timeout of 10 minutes, so that the line
    cannot have come from rank 0's wait; both ranks exit 1, rank 1 printing nothing."""
    out = tmp_path / "srun"
    zero, one = _srun(out, "collective_cases:LastRankRaises", "--collective-timeout", "600")
    assert (zero.returncode, one.returncode) == (1, 1), (zero, one)
    assert one.stdout == "", one.stdout
    table = _written_once(out, zero, "| loss | gather | world_size |")
    assert table["verdict"].tolist() == ["failed"]
    assert table["error"].tolist() == ["rank 1: ValueError: the last rank stops here"]
    assert "W = 2: failed" in zero.stdout
