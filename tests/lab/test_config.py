"""Every experiment composes and passes the checks; bad values fail with one line naming them."""

from __future__ import annotations

import shutil

import pytest
from helpers import REPO, compose, run_command
from omegaconf import OmegaConf

from gatherlab import gather as gathering
from gatherlab.components import config
from gatherlab.lab import preflight, validation
from gatherlab.lab.validation import ConfigError

EXPERIMENTS = sorted(path.stem for path in (config.CONFIG_DIR / "experiment").glob("*.yaml"))
assert EXPERIMENTS, f"no experiment configs in {config.CONFIG_DIR}"  # else the test would skip


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_checks(experiment):
    cfg, choices = compose(f"experiment={experiment}")
    validation.validate(cfg)
    assert choices["experiment"] == experiment
    assert cfg.global_batch_size % cfg.layout.devices == 0


def test_group_options_count_every_search_path_entry(tmp_path, monkeypatch):
    # A user's configs in a folder (file://) and inside an importable package (pkg://), as Hydra's
    # searchpath takes them: their gathers are options beside the built-in ones.
    (tmp_path / "folder" / "gather").mkdir(parents=True)
    (tmp_path / "folder" / "gather" / "from_folder.yaml").write_text("_target_: x.Y\n")
    (tmp_path / "userpkg" / "conf" / "gather").mkdir(parents=True)
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "conf" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "conf" / "gather" / "from_package.yaml").write_text("_target_: x.Y\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'folder'},pkg://userpkg.conf]"
    with config.composed():
        options = config.group_options("gather", [searchpath])
    assert options == sorted([*gathering.NAMES, "native", "from_folder", "from_package"])


def test_a_config_file_that_is_no_yaml_is_one_line_naming_its_line(tmp_path):
    """A user's config with a line missing its colon was a 110-line traceback (PyYAML's error,
    which Hydra passes on), exit status 1."""
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "typo.yaml").write_text("_target_: x.Y\nt 2.0\n")
    with pytest.raises(ConfigError) as error, config.composed():
        config.compose_with_hydra([f"hydra.searchpath=[file://{tmp_path}]", "loss=typo"])
    assert str(error.value) == (
        f"{tmp_path / 'loss' / 'typo.yaml'}, line 2 is not YAML (could not find expected ':'); "
        "allowed: one `key: value` per line"
    )


def test_pr1531_experiment_is_the_pr_test_case():
    cfg, choices = compose("experiment=lightly_pr1531")
    assert (choices["model"], choices["data"], choices["loss"]) == ("linear", "arange", "ntxent")
    assert cfg.model.weight == [[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]]
    assert (cfg.optim.lr, cfg.steps, cfg.global_batch_size, cfg.precision) == (
        0.01, 10, 8, "32-true",
    )  # fmt: skip


def test_bug_demo_sweeps_reference_old_and_fixed():
    with config.composed():
        jobs = config.job_overrides(["experiment=bug_demo"], multirun=True)
    combos = {
        tuple(sorted(o for o in job if o.split("=")[0] in ("gather", "layout"))) for job in jobs
    }
    assert combos == {
        (f"gather={g}", f"layout={layout}")
        for g in ("old", "fixed")
        for layout in ("cpu1", "cpu2", "cpu4")
    }
    cfg, _ = compose("experiment=bug_demo")
    assert cfg.precision == "64-true" and cfg.steps >= 50


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["gather=nope"],
            "gather='nope' is unknown; allowed: avg, fixed, fixed_all_reduce, "
            "fixed_reduce_scatter, functional, lightning, native, nograd, nograd_swap, old, "
            "torch_nn",
        ),
        (["layout=cpu3"], "layout='cpu3' is unknown; allowed: cpu1, cpu1_floor, cpu2, cpu4, cpu8"),
        (
            ["layout=cpu4", "global_batch_size=6"],
            "global_batch_size=6 does not divide by layout.devices=4",
        ),
        (["steps=0"], "steps=0 is not allowed; allowed: a positive integer"),
        (
            ["precision=8-mixed"],
            "precision='8-mixed' is not allowed; allowed: 64-true, 32-true, bf16-mixed",
        ),
        (["global_batch_size=512"], "global_batch_size=512 exceeds the 256 samples of the data"),
        (["global_batch_size=0"], "global_batch_size=0 is not allowed; allowed: a positive"),
        (["loss=infonce"], "loss='infonce' is unknown; allowed: barlowtwins"),
        (["loss=user"], "loss._target_ is missing; allowed: an import path"),
        (["loss=user", "loss._target_=nopkg:Loss"], "loss._target_=nopkg:Loss: cannot import"),
        (
            ["model=resnet"],
            "model='resnet' is unknown; allowed: linear, mlp, moe, norm_mlp, simclr, tiny_lm",
        ),
        (["layout.accelerator=tpu"], "layout.accelerator='tpu' is unknown; allowed: cpu, gpu"),
        (["layout=gpu2", "launcher=pool"], "launcher=pool is not allowed with"),
        (["model=simclr", "data=digits", "model.norm=sync"], "model.norm='sync'"),
        (["layout=gpu1", "layout.nodes=2"], "layout.nodes=2 needs ranks started on every node"),
        # a constructor's refusal, found by building the job's objects before any job starts
        (
            ["loss.temperature=0"],
            "loss (gatherlab.losses.NTXentLoss): temperature must be a positive number, got 0",
        ),
        (["optim.lr=-1"], "optim (torch.optim.SGD): Invalid learning rate: -1"),
        # experiments that another command runs are refused, naming that command
        (
            ["experiment=optimizer_matrix"],
            "experiment=optimizer_matrix is run by 'python experiments/optimizer_matrix.py', not "
            "by 'python -m gatherlab.train'; allowed: python experiments/optimizer_matrix.py",
        ),
        (
            ["experiment=gather_scaling"],
            "experiment=gather_scaling is run by 'python -m gatherlab.scaling', not by 'python -m "
            "gatherlab.train'; allowed: python -m gatherlab.scaling",
        ),
        (
            ["model.depth=0"],
            "model (gatherlab.components.models.MLP): model.depth must be at least 1",
        ),
        (
            ["gather=fixed_reduce_scatter", "gather.collective=bogus"],
            "gather (gatherlab.gather.Fixed): collective='bogus' is not allowed; allowed: "
            "all_reduce, reduce_scatter",
        ),
        (
            ["loss._target_=gatherlab.losses.Nope"],
            "loss._target_=gatherlab.losses.Nope: gatherlab.losses has no attribute 'Nope'",
        ),
    ],
)
def test_bad_values_raise_one_line(overrides, message):
    # As the command checks a job: Hydra composes it (its refusal is one line too), then the
    # check reads that config (a single run's in Hydra's callback before the run's directory is
    # made, which ends the command with this line; a sweep's all before the first starts).
    with pytest.raises(ConfigError) as error, config.composed():
        preflight.validate_job(config.compose_with_hydra(overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("launcher", ["spawn", "external"])
def test_a_gpu_layout_on_too_few_gpus_is_refused_for_every_launcher(launcher, monkeypatch):
    # torchrun's and SLURM's ranks (launcher=external) included: each refuses before Lightning
    # starts. layout.devices counts one node's GPUs, so two nodes of 2 need 2 here, not 4.
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as error, config.composed():
        preflight.validate_job(config.compose_with_hydra(["layout=gpu4", f"launcher={launcher}"]))
    assert str(error.value) == (
        "layout.devices=4 GPUs asked for, this machine has 1; allowed: a cpu layout, or at most "
        "1 GPUs"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"has 0; allowed: a cpu layout$"), config.composed():
        preflight.validate_job(config.compose_with_hydra(["layout=gpu1", f"launcher={launcher}"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with config.composed():
        overrides = ["layout=gpu2", "layout.nodes=2", "launcher=external"]
        preflight.validate_job(config.compose_with_hydra(overrides))


def _compositions(monkeypatch) -> dict[str, list[list[str]]]:
    """What Hydra's config loader composes from now on in this process, in order: whole configs
    (``load_configuration``: a single run's, a sweep's own) and sweep jobs (``load_sweep_config``).
    No public API counts compositions: the test patches the loader's class, Hydra's one
    implementation of ``hydra.core.config_loader.ConfigLoader``."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    composed: dict[str, list[list[str]]] = {"load_configuration": [], "load_sweep_config": []}
    configuration = ConfigLoaderImpl.load_configuration
    sweep_config = ConfigLoaderImpl.load_sweep_config
    in_job = []

    def counted_configuration(self, config_name, overrides, *args, **kwargs):
        if not in_job:  # a job's composition calls load_configuration once more: counted there
            composed["load_configuration"].append(list(overrides))
        return configuration(self, config_name, overrides, *args, **kwargs)

    def counted_sweep_config(self, master_config, sweep_overrides):
        composed["load_sweep_config"].append(list(sweep_overrides))
        in_job.append(True)
        try:
            return sweep_config(self, master_config, sweep_overrides)
        finally:
            in_job.pop()

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted_configuration)
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counted_sweep_config)
    return composed


@pytest.mark.slow
def test_each_job_is_composed_once_and_runs_that_config(tmp_path, monkeypatch):
    # A sweep: gatherlab's sweeper composes each job once (2 compositions for 2 jobs), the command
    # checks them all, and the launcher runs each job on that config: its request for the job's
    # config is answered from the sweeper's compositions (Hydra's basic sweeper composes each job
    # twice: to validate the batch, and again in its launcher). Besides, Hydra composes the
    # sweep's own config twice (to read its mode, and to run it).
    composed = _compositions(monkeypatch)
    sweep = tmp_path / "s"
    result = run_command("train", "-m", "seed=0,1", "steps=1", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-2000:]
    typed = ["seed=0,1", "steps=1", f"hydra.sweep.dir={sweep}", "~hydra.callbacks.close_pools"]
    assert composed == {
        "load_configuration": [typed, [*typed, "hydra.mode=MULTIRUN"]],
        "load_sweep_config": [["seed=0", "steps=1"], ["seed=1", "steps=1"]],
    }
    for number, seed in ((0, 0), (1, 1)):
        ran = OmegaConf.load(sweep / str(number) / ".hydra" / "config.yaml")
        assert (ran.seed, ran.steps) == (seed, 1)
        assert list(OmegaConf.load(sweep / str(number) / ".hydra" / "overrides.yaml")) == [
            f"seed={seed}",
            "steps=1",
        ]
    # A single run: only Hydra composes it (to read its mode, and to run it); the check is of the
    # config Hydra hands its callback before it makes the run's directory.
    composed["load_configuration"].clear()
    composed["load_sweep_config"].clear()
    run = tmp_path / "r"
    result = run_command("train", "seed=2", "steps=1", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-2000:]
    typed = ["seed=2", "steps=1", f"hydra.run.dir={run}"]
    assert composed == {
        "load_configuration": [typed, [*typed, "hydra.mode=RUN"]],
        "load_sweep_config": [],
    }
    assert OmegaConf.load(run / ".hydra" / "config.yaml").seed == 2


@pytest.mark.slow
def test_a_large_sweep_composed_on_all_cores_runs_in_one_directory(tmp_path, monkeypatch):
    # The sweep directory's ${now:...} is resolved once, before the jobs are composed (in forked
    # processes here), and each job's config carries that value: else each resolves its own.
    monkeypatch.setattr(preflight, "PARALLEL_COMPOSITION", 3)
    monkeypatch.setattr(preflight, "_cores", lambda: 2)
    monkeypatch.chdir(tmp_path)  # the default directory: multirun/${now:...}
    composed = _compositions(monkeypatch)
    result = run_command("train", "-m", "seed=0,1,2", "steps=1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert composed["load_sweep_config"] == [["seed=0", "steps=1"]]  # the others: forked
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert sorted(path.name for path in sweep.iterdir() if path.is_dir()) == ["0", "1", "2"]
    seeds = [OmegaConf.load(sweep / str(n) / ".hydra" / "config.yaml").seed for n in range(3)]
    assert seeds == [0, 1, 2]


def test_a_large_sweep_of_a_data_set_built_with_threads_is_checked_without_hanging(monkeypatch):
    # The first job is checked here, building the digits in torch's OpenMP threads; the others in
    # processes forked after that, where a parallel region of the parent's (libgomp's) threads
    # would wait forever for threads that were not forked. The last job's batch is too large for
    # the data set: the check that builds the data set answers for it, from a fork.
    import torch

    monkeypatch.setattr(preflight, "PARALLEL_COMPOSITION", 3)
    monkeypatch.setattr(preflight, "_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a user's process: OpenMP on every core
    try:
        result = run_command(
            "train", "-m", "data=digits", "model=simclr", "seed=0,1", "global_batch_size=16,4096"
        )
    finally:
        torch.set_num_threads(threads)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert "global_batch_size=4096" in line and "1437" in line, line


def _sweep_jobs(experiment: str) -> list[dict[str, str]]:
    """The overrides of each job of ``-m experiment=<experiment>``, as key → value."""
    with config.composed():
        jobs = config.job_overrides([f"experiment={experiment}"], multirun=True)
    return [dict(override.split("=") for override in job) for job in jobs]


def test_the_downstream_experiment_is_every_run_its_figure_reads():
    # experiments/downstream.py runs `-m experiment=downstream` alone: the sweep must hold each
    # cell of the figure for seeds 0..29: the 1-device run of each loss; on 4 ranks ntxent with
    # fixed and with old, ntxent_global with old (each cell one option of conf/downstream_cell)
    jobs = _sweep_jobs("downstream")
    cells = {"reference", "reference_global", "fixed", "old_local", "old_global"}
    assert len(jobs) == 150
    assert {(job["seed"], job["downstream_cell"]) for job in jobs} == {
        (str(seed), cell) for seed in range(30) for cell in cells
    }
    composed = {}  # each cell's choices, read from its file (composing five configs takes ~1 s)
    for cell in cells:
        defaults = OmegaConf.load(REPO / "conf" / "downstream_cell" / f"{cell}.yaml").defaults
        choices = {
            key.removeprefix("override /"): value for d in defaults for key, value in d.items()
        }
        composed[cell] = (choices["loss"], choices["gather"], choices["layout"])
    assert composed == {
        "reference": ("ntxent", "fixed", "cpu1"),
        "reference_global": ("ntxent_global", "fixed", "cpu1"),
        "fixed": ("ntxent", "fixed", "cpu4"),
        "old_local": ("ntxent", "old", "cpu4"),
        "old_global": ("ntxent_global", "old", "cpu4"),
    }


def test_the_learning_rate_sweep_is_every_run_its_figure_reads():
    # experiments/lr_sweep.py: 4 ranks, fixed and old × both NT-Xent styles × six learning rates
    # log-spaced by 2, holding the experiment's lr 0.5 and lr·W = 2, over seeds 0..4
    jobs = _sweep_jobs("lr_sweep")
    assert sorted((j["seed"], j["loss"], j["gather"], float(j["optim.lr"])) for j in jobs) == [
        (str(seed), loss, gather, lr)
        for seed in range(5)
        for loss in ("ntxent", "ntxent_global")
        for gather in ("fixed", "old")
        for lr in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    ]
    cfg, choices = compose("experiment=lr_sweep")
    assert (choices["layout"], cfg.optim.lr, cfg.optim._target_) == ("cpu4", 0.5, "torch.optim.SGD")


def test_more_cpu_ranks_than_cores_is_a_warning_with_the_count():
    import os

    cores = len(os.sched_getaffinity(0))
    cfg, _ = compose(f"layout.devices={cores + 1}", f"global_batch_size={4 * (cores + 1)}")
    warning = validation.machine_warning(cfg)
    assert f"layout.devices={cores + 1} CPU ranks on {cores} core(s)" in warning
    assert validation.machine_warning(compose("layout=cpu1")[0]) is None


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        # the groups (directories of conf/) and the primary config's keys (conf/config.yaml)
        ("layuot=cpu2", ["global_batch_size", "layout", "model", "seed", "steps"]),
        # below a group: the keys of the option chosen (its default, conf/model/mlp.yaml)
        ("model.nrom=global", ["depth", "hidden_features", "in_features", "out_features"]),
        # the chosen option's keys alone: another loss's (lambda_param, learn_logit_scale) were
        # named beside a key the chosen one lacks that others have (a user's loss.temperature)
        ("loss.tt=3", ["_target_", "temperature"]),
    ],
)
def test_a_key_the_config_lacks_is_one_line_naming_the_keys_it_has(override, allowed):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as error, config.composed():
        config.compose_with_hydra(["loss=ntxent", override] if key == "loss.tt" else [override])
    line = str(error.value)
    start, _, rest = line.partition("; allowed: ")
    assert start == f"{key} is not a key of the config"
    assert rest.endswith(f", or +{key}=VALUE to add it") and "\n" not in line
    named = rest.removesuffix(f", or +{key}=VALUE to add it").split(", ")
    assert set(allowed) <= set(named) and key not in named
    assert named == sorted(named)
    if key == "loss.tt":
        assert named == allowed, named


def test_the_keys_named_are_no_bytecode_cache(tmp_path, monkeypatch):
    """Python writes conf/__pycache__ beside conf/__init__.py (the configs travel as a package)
    wherever bytecode is written: it was named among the config's keys, `-` binding before `|`
    in its removal."""
    shutil.copytree(config.CONFIG_DIR, tmp_path / "conf",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (tmp_path / "conf" / "__pycache__").mkdir()
    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path / "conf")
    named = config.known_keys("step")
    assert "__pycache__" not in named and {"layout", "steps"} <= set(named)
