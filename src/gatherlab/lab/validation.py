"""The one validation of a composed job config (layout × launcher × batch × data × precision × the
objects it names), failing with one line that names the key, the value and what is allowed.

It runs before any worker process starts, for every job of a command (an audit's gathers, once
built, by ``validate_audit_gathers``); what runs a job trusts it. ("Check" names gatherlab's
check of a loss, gather or training step, `gatherlab.check`, and nothing else.)
Besides the values it builds the cheap objects of the job (data set, model, gather, loss, and the
optimizer on a stand-in parameter), so that a constructor's refusal is one line too, and checks
the data set and model contracts of docs/design.md §4; with ``module=user``, the user's
LightningModule and map-style data set instead, and the ``removals.*`` keys.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.components.accumulation import Accumulation
from gatherlab.components.config import ConfigError
from gatherlab.core import cli, terms
from gatherlab.core.imports import locate
from gatherlab.gather import rule
from gatherlab.runs import plainstep, removals

ACCELERATORS = tuple(terms.Accelerator)
ACCUMULATIONS = tuple(Accumulation)


__all__ = [
    "ConfigError", "machine_warning", "validate", "validate_audit_gathers", "validate_command",
]  # fmt: skip


def _integer(key: str, value: Any, minimum: int) -> int:
    if not terms.is_integer(value, minimum):
        raise ConfigError(
            f"{key}={value!r} is not allowed; allowed: {terms.allowed_integer(minimum)}"
        )
    return value


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for the first value of ``cfg`` that cannot run."""
    _integer("steps", cfg["steps"], minimum=1)
    _integer("seed", cfg["seed"], minimum=0)
    _integer("log_every", cfg.get("log_every", 0), minimum=0)
    global_batch_size = _integer("global_batch_size", cfg["global_batch_size"], minimum=1)
    devices = _validate_layout(cfg)
    if global_batch_size % devices:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide by layout.devices={devices}; "
            f"allowed: a multiple of {devices}"
        )
    _validate_micro_batches(cfg, global_batch_size // devices)
    _validate_row_blocks(cfg, devices)
    _validate_strategy(cfg, devices)
    removed = removals_of(cfg)
    if config.is_user_module(cfg):
        if devices > 1 and cfg["launcher"]["name"] != terms.Launcher.POOL:
            raise ConfigError(
                f"module=user builds the module inside each rank of the worker pools; "
                f"launcher={cfg['launcher']['name']} with {devices} devices is not supported; "
                "allowed: launcher=pool (CPU layouts), or one device"
            )
        num_samples = _validate_user_objects(cfg)
    else:
        _validate_contrastive_only(cfg, removed)
        num_samples = _dataset_size(OmegaConf.to_yaml(cfg["data"]["dataset"], resolve=True))
    if global_batch_size > num_samples:
        raise ConfigError(
            f"global_batch_size={global_batch_size} exceeds the {num_samples} samples of the data "
            f"set; allowed: at most {num_samples}"
        )
    if not config.is_user_module(cfg):
        _validate_objects(cfg)
    if "audit" in cfg:
        _validate_audit(cfg)


def _validate_layout(cfg: Mapping[str, Any]) -> int:
    """The layout, precision and launcher, against each other and this machine; returns the
    run's ranks in all (devices × nodes)."""
    nodes = _integer("layout.nodes", cfg["layout"].get("nodes", 1), minimum=1)
    devices = _integer("layout.devices", cfg["layout"]["devices"], minimum=1) * nodes
    accelerator = cfg["layout"]["accelerator"]
    if accelerator not in ACCELERATORS:
        raise ConfigError(
            f"layout.accelerator={accelerator!r} is unknown; allowed: {', '.join(ACCELERATORS)}"
        )
    if cfg["precision"] not in terms.PRECISIONS:
        allowed = ", ".join(terms.PRECISIONS)
        raise ConfigError(f"precision={cfg['precision']!r} is not allowed; allowed: {allowed}")
    launcher = cfg["launcher"]["name"]
    if launcher == terms.Launcher.POOL and accelerator != terms.Accelerator.CPU:
        raise ConfigError(
            f"launcher=pool is not allowed with layout.accelerator={accelerator!r}; "
            "allowed: launcher=spawn or launcher=external"
        )
    if nodes > 1 and launcher != terms.Launcher.EXTERNAL:
        raise ConfigError(
            f"layout.nodes={nodes} needs ranks started on every node; allowed: launcher=external "
            "(torchrun or SLURM), or layout.nodes=1"
        )
    # Every launcher, torchrun's and SLURM's ranks too: each rank refuses in one line (exit 2)
    # before Lightning finds no GPU in every rank. layout.devices counts a node's GPUs.
    if accelerator == terms.Accelerator.GPU:
        available = torch.cuda.device_count()
        if available < cfg["layout"]["devices"]:
            fewer = f", or at most {available} GPUs" if available else ""
            raise ConfigError(
                f"layout.devices={cfg['layout']['devices']} GPUs asked for, this machine has "
                f"{available}; allowed: a cpu layout{fewer}"
            )
    if cfg["model"].get("norm") == "sync" and accelerator == terms.Accelerator.CPU:
        raise ConfigError(
            "model.norm='sync' (torch's SyncBatchNorm) refuses CPU tensors; allowed with "
            "layout.accelerator=cpu: global (the same statistics, on any backend), local"
        )
    return devices


def _validate_micro_batches(cfg: Mapping[str, Any], rows: int) -> None:
    """``layout.micro_batches`` (K) divides each rank's ``rows``; ``layout.accumulation`` is one
    of `Accumulation`, ``none`` only with K = 1, and only for gatherlab's own module (a user's
    module accumulates by itself) on a model without batch norm (its statistics would be a
    micro-batch's)."""
    layout = cfg["layout"]
    count = _integer("layout.micro_batches", layout.get("micro_batches", 1), minimum=1)
    accumulation = layout.get("accumulation", Accumulation.NONE)
    if accumulation not in ACCUMULATIONS:
        raise ConfigError(
            f"layout.accumulation={accumulation!r} is unknown; allowed: {', '.join(ACCUMULATIONS)}"
        )
    if rows % count:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        raise ConfigError(
            f"layout.micro_batches={count} does not divide the {rows} rows of each rank "
            f"(global_batch_size / devices); allowed: {', '.join(map(str, divisors))}"
        )
    if accumulation == Accumulation.NONE:
        if count > 1:
            raise ConfigError(
                f"layout.micro_batches={count} with layout.accumulation=none; allowed: "
                "layout.accumulation=naive or cached, or layout.micro_batches=1"
            )
        return
    if config.is_user_module(cfg):
        raise ConfigError(
            f"layout.accumulation={accumulation} is gatherlab's own module's (module=contrastive); "
            "allowed with module=user: layout.accumulation=none (the module accumulates itself)"
        )
    if cfg["model"].get("norm") is not None:
        raise ConfigError(
            f"layout.accumulation={accumulation} with model.norm={cfg['model']['norm']!r}: batch "
            "norm would see a micro-batch's statistics; allowed: a model without batch norm "
            "(model=mlp, linear), or layout.accumulation=none"
        )


STRATEGIES = tuple(terms.Strategy)


def _validate_strategy(cfg: Mapping[str, Any], devices: int) -> None:
    """``strategy`` (docs/checking.md §10 "Sharded code"): one of `terms.Strategy`, its FSDP2
    options typed; other than ``ddp`` only for gatherlab's own module, trained on the worker
    pools (several devices), without accumulation (its manual step averages whole gradients),
    and FSDP2 and ``tp`` not in ``16-mixed`` (Lightning's ``ModelParallelStrategy`` refuses it);
    ``tp``'s own options by `_validate_tensor_parallel`."""
    strategy = cfg.get("strategy") or {"name": terms.Strategy.DDP}
    name = strategy.get("name")
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name={name!r} is unknown; allowed: {', '.join(STRATEGIES)}")
    for key in ("reshard_after_forward", "reduce_outside", "sequence_parallel", "reduce_norm",
                "scale_grads", "sum_tied", "scale_experts"):  # fmt: skip
        if not isinstance(strategy.get(key, True), bool):
            raise ConfigError(
                f"strategy.{key}={strategy[key]!r} is not allowed; allowed: true or false"
            )
    factor = strategy.get("divide_factor")
    if factor is not None and not (
        isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 0
    ):
        raise ConfigError(
            f"strategy.divide_factor={factor!r} is not allowed; allowed: null (FSDP2's mean) "
            "or a number > 0"
        )
    _validate_pipeline(cfg, name, strategy, devices)
    if name == terms.Strategy.DDP:
        return
    if config.is_user_module(cfg):
        raise ConfigError(
            f"strategy={name} shards gatherlab's own module (module=contrastive); allowed with "
            "module=user: strategy=ddp"
        )
    launcher = cfg["launcher"]["name"]
    if devices > 1 and launcher != terms.Launcher.POOL:
        raise ConfigError(
            f"strategy={name} with launcher={launcher} is not supported; allowed: "
            "launcher=pool (CPU layouts), or strategy=ddp"
        )
    accumulation = cfg["layout"].get("accumulation", Accumulation.NONE)
    if accumulation != Accumulation.NONE:
        raise ConfigError(
            f"strategy={name} with layout.accumulation={accumulation}: the accumulating step "
            "averages whole gradients by itself; allowed: layout.accumulation=none, or strategy=ddp"
        )
    if name != terms.Strategy.ZERO and cfg["precision"] == terms.Precision.FP16_MIXED:
        raise ConfigError(
            f"strategy={name} with precision=16-mixed: Lightning's ModelParallelStrategy refuses "
            "it; allowed: 64-true, 32-true, bf16-mixed, bf16-true"
        )
    _validate_tensor_parallel(cfg, name, strategy, devices)
    if name == terms.Strategy.EP:
        _validate_experts(cfg, devices)


def _validate_experts(cfg: Mapping[str, Any], devices: int) -> None:
    """``strategy=ep`` (docs/checking.md §10 "Expert parallelism in the lab"): a model whose
    experts spread over the ranks (``expert_parallel``, ``model=moe``), as many of them on each
    rank."""
    model = config.build_model(cfg)
    target = cfg["model"]["_target_"]
    if not callable(getattr(model, "expert_parallel", None)):
        raise ConfigError(
            f"strategy=ep spreads a mixture of experts' experts over the ranks, and model "
            f"({target}) has none; allowed: model=moe"
        )
    experts = len(model.experts)
    if devices > 1 and experts % devices:
        multiples = f"a multiple of {devices}"
        raise ConfigError(
            f"model.experts={experts} does not divide over the layout's {devices} ranks under "
            f"strategy=ep; allowed: {multiples}"
        )


def _validate_pipeline(
    cfg: Mapping[str, Any], name: str, strategy: Mapping[str, Any], devices: int
) -> None:
    """``strategy=pp`` (docs/checking.md §10 "Pipeline parallelism in the lab"): a language model
    that cuts itself into stages (``pipeline_stages``, ``model=tiny_lm``) on token data, and that
    model under ``pp`` alone; ``pipeline_parallel`` dividing the layout's ranks, one of
    `Schedule`, and ``micro_batches`` dividing each pipeline's rows in as many as the schedule
    takes (1F1B: at least one per stage; interleaved: a multiple of the pipeline's ranks), the
    model deep enough for a block per stage. Checked on one device too (it trains the plain run,
    the sweep's reference)."""
    if config.is_user_module(cfg):
        return  # refused by the caller: a user's module trains under ddp alone
    pipelined = name == terms.Strategy.PP
    try:
        model_cuts = callable(getattr(locate(str(cfg["model"]["_target_"])), "pipeline_stages", 0))
    except Exception:  # no model to read: _validate_objects says why in one line
        return
    if model_cuts != pipelined:
        target = cfg["model"]["_target_"]
        raise ConfigError(
            f"strategy={name} with model ({target}): "
            + ("strategy=pp trains a language model cut into pipeline stages, which this model "
               "is not; allowed: model=tiny_lm" if pipelined else
               "a language model cut into pipeline stages is trained by strategy=pp alone; "
               "allowed: strategy=pp, or a model of a view (model=mlp, norm_mlp, ...)")
        )  # fmt: skip
    if not pipelined:
        return
    blocks = cfg["layout"].get("row_blocks", 1)
    if blocks != 1:
        raise ConfigError(
            f"layout.row_blocks={blocks} with strategy=pp: its module runs one device's batch "
            "whole, with no floor run in row blocks; allowed: layout.row_blocks=1 (a low precision "
            "judged by the check, python -m gatherlab.check --pipeline-parallel)"
        )
    _validate_pipeline_layout(cfg, strategy, devices)
    item = config.instantiate("data", cfg["data"]["dataset"])[(0, 0)]
    if item[0].is_floating_point():
        raise ConfigError(
            "strategy=pp with a data set of real-valued views: its language model reads token ids; "
            "allowed: data=tokens"
        )


def _validate_pipeline_layout(
    cfg: Mapping[str, Any], strategy: Mapping[str, Any], devices: int
) -> None:
    """``strategy=pp``'s degree, schedule and micro-batches at a layout of ``devices`` ranks
    (`_validate_pipeline`'s), and the model's stages at that many: the schedule's own
    requirements, each one line."""
    from gatherlab.components.pipeline import Schedule

    size = _integer("strategy.pipeline_parallel", strategy.get("pipeline_parallel", 1), minimum=1)
    if devices > 1 and devices % size:
        divisors = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
        raise ConfigError(
            f"strategy.pipeline_parallel={size} does not divide the layout's {devices} ranks "
            f"(layout.devices × layout.nodes); allowed: {divisors}"
        )
    schedule = strategy.get("schedule", Schedule.ONE_F_ONE_B)
    if schedule not in tuple(Schedule):
        raise ConfigError(
            f"strategy.schedule={schedule!r} is not supported; allowed: {', '.join(Schedule)}"
        )
    schedule = Schedule(schedule)
    count = _integer("strategy.micro_batches", strategy.get("micro_batches", 1), minimum=1)
    if devices > 1:
        rows = cfg["global_batch_size"] // (devices // size)
        if rows % count:
            divisors = ", ".join(str(d) for d in range(1, rows + 1) if rows % d == 0)
            raise ConfigError(
                f"strategy.micro_batches={count} does not divide the {rows} rows of each "
                f"pipeline (global_batch_size / the data-parallel groups); allowed: {divisors}"
            )
        stages = size * schedule.stages_per_rank
        if schedule == Schedule.INTERLEAVED_1F1B and count % size:
            raise ConfigError(
                f"strategy.micro_batches={count} with strategy.schedule={schedule}: interleaved "
                f"1F1B takes a multiple of the pipeline's {size} ranks; allowed: a multiple of "
                f"{size} that divides {rows}"
            )
        if schedule == Schedule.ONE_F_ONE_B and count < stages:
            raise ConfigError(
                f"strategy.micro_batches={count} with strategy.schedule={schedule}: 1F1B takes at "
                f"least one micro-batch per stage ({stages}); allowed: at least {stages}"
            )
        try:
            config.build_model(cfg).pipeline_stages(stages)
        except ValueError as error:
            raise ConfigError(f"model ({cfg['model']['_target_']}): {error}") from None


def _validate_tensor_parallel(
    cfg: Mapping[str, Any], name: str, strategy: Mapping[str, Any], devices: int
) -> None:
    """``strategy.tensor_parallel`` (``tp``'s alone, docs/checking.md §10 "Sharded code"): a
    positive integer that divides the layout's ranks (one device trains the plain run), on a model
    with a plan that splits it (``tensor_parallel_plan``, e.g. ``model=norm_mlp``) by that
    degree, and data whose views both go through the model (the plan splits the rows it
    encodes)."""
    degree = _integer("strategy.tensor_parallel", strategy.get("tensor_parallel", 1), minimum=1)
    if name != terms.Strategy.TP:
        if degree != 1:
            raise ConfigError(
                f"strategy.tensor_parallel={degree} is strategy=tp's; allowed with "
                f"strategy={name}: strategy.tensor_parallel=1, or strategy=tp"
            )
        return
    if devices > 1 and devices % degree:
        divisors = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
        raise ConfigError(
            f"strategy.tensor_parallel={degree} does not divide the layout's {devices} ranks "
            f"(layout.devices × layout.nodes); allowed: {divisors}"
        )
    model = config.build_model(cfg)
    target = cfg["model"]["_target_"]
    if not callable(getattr(model, "tensor_parallel_plan", None)):
        raise ConfigError(
            f"strategy=tp splits the model by its tensor_parallel_plan(tensor_parallel, "
            f"sequence_parallel), which model ({target}) does not have; allowed: model=norm_mlp"
        )
    try:
        model.tensor_parallel_plan(degree, strategy.get("sequence_parallel", True))
    except ValueError as error:
        raise ConfigError(f"model ({target}): {cli.first_line(error)}") from None
    dataset = config.instantiate("data", cfg["data"]["dataset"])
    if not getattr(dataset, "encode_second_view", True):
        raise ConfigError(
            "strategy=tp with a data set whose second view is a fixed target (not encoded): the "
            "model's plan splits only the rows it encodes; allowed: a data set whose views both "
            "go through the model (data=gaussian, digits), or strategy=fsdp2"
        )


def _validate_row_blocks(cfg: Mapping[str, Any], devices: int) -> None:
    """``layout.row_blocks``, the floor's run of a low precision (docs/design.md §2): one device
    taking the whole batch, gatherlab's own module, a model without batch norm (the blocks would
    split its statistics); and fp16 (``16-mixed``) with accumulation ``none`` only (the module's
    manual backward of the earlier micro-batches applies no gradient scaler)."""
    layout = cfg["layout"]
    blocks = _integer("layout.row_blocks", layout.get("row_blocks", 1), minimum=1)
    if cfg["precision"] == terms.Precision.FP16_MIXED and layout.get("accumulation", "none") != (
        Accumulation.NONE
    ):
        raise ConfigError(
            f"precision=16-mixed with layout.accumulation={layout['accumulation']}: its "
            "micro-batches' backwards apply no gradient scaler; allowed: layout.accumulation=none, "
            "or precision=bf16-mixed"
        )
    if blocks == 1:
        return
    if devices > 1 or layout.get("micro_batches", 1) > 1:
        raise ConfigError(
            f"layout.row_blocks={blocks} is one device's floor run; allowed with "
            f"{devices} devices × {layout.get('micro_batches', 1)} micro-batches: "
            "layout.row_blocks=1 (the floor: layout=cpu1_floor)"
        )
    if config.is_user_module(cfg):
        raise ConfigError(
            f"layout.row_blocks={blocks} splits gatherlab's own module's forward; allowed with "
            "module=user: layout.row_blocks=1"
        )
    if cfg["model"].get("norm") is not None:
        raise ConfigError(
            f"layout.row_blocks={blocks} with model.norm={cfg['model']['norm']!r}: the blocks "
            "would split batch norm's statistics; allowed: a model without batch norm (model=mlp, "
            "linear), or layout.row_blocks=1"
        )


def _validate_audit(cfg: DictConfig) -> None:
    """An audit's world sizes: real and simulated, each an integer ≥ 2 dividing the batch."""
    for key in ("world_sizes", "simulated_world_sizes"):
        for size in cfg.audit.get(key) or []:
            if not terms.is_integer(size, 2) or cfg.global_batch_size % size:
                raise ConfigError(
                    f"audit.{key} holds {size!r}; allowed: integers ≥ 2 that divide "
                    f"global_batch_size={cfg.global_batch_size}"
                )


def validate_audit_gathers(cfg: DictConfig, gathers: Mapping[str, Any]) -> None:
    """The gathers an audit measures (name → gather, built from ``audit.gathers``): with
    simulated world sizes, each must name the backward rule the simulated world reproduces."""
    unsimulatable = [name for name, gather in gathers.items() if rule(gather) is None]
    if cfg.audit.get("simulated_world_sizes") and unsimulatable:
        raise ConfigError(
            f"audit.simulated_world_sizes: gather {unsimulatable[0]} names no backward rule to "
            f"simulate; allowed: gathers whose backward rule is one of "
            f"{', '.join(terms.Rule)} (docs/design.md §9), or no simulated world sizes"
        )


def removals_of(cfg: DictConfig) -> removals.Removals:
    """The removals a run's ``removals.*`` keys ask for (`gatherlab.runs.removals`)."""
    try:
        return removals.Removals.from_config(cfg.get("removals"))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_contrastive_only(cfg: DictConfig, removed: removals.Removals) -> None:
    """gatherlab's own module has its own switches for the removals (``model.norm``,
    ``data.seeding``) and reads its data by ``(epoch, index)``: ``removals.*`` and
    ``data=user`` are for ``module=user``."""
    if removed.made():
        key = removed.made()[0]
        raise ConfigError(
            f"removals.{key}={cfg.removals[key]} applies to module=user; allowed with "
            f"module=contrastive: removals.{key}={key.config_values[0]} (gatherlab's "
            "own switches: model.norm, data.seeding)"
        )
    if config.is_user_data(cfg):
        raise ConfigError(
            "data=user (a map-style data set read by index) serves module=user; allowed "
            "with module=contrastive: a data set of docs/design.md §4 (data=gaussian, digits, ...)"
        )


def _validate_user_objects(cfg: DictConfig) -> int:
    """Build the user's module (as on one device: rank 0 of 1) and data set once, apply the
    removals, check both contracts; return the data set's number of samples."""
    from gatherlab.runs import fit

    factory = config.module_factory(cfg)
    target = cfg.module._target_
    try:
        module = factory()
    except Exception as error:  # the constructor's own refusal
        raise ConfigError(f"module ({target}): {cli.first_line(error)}") from None
    try:
        fit.validated_module(module, f"module ({target})")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    removals_of(cfg).apply(module)
    if not config.is_user_data(cfg):
        raise ConfigError(
            "module=user reads a map-style data set by index, not a data set of gatherlab's "
            "contract; allowed: data=user data.dataset._target_=mypkg.data:MyData"
        )
    factory = config.dataset_factory(cfg)
    data_target = cfg.data.dataset._target_
    try:
        dataset = factory()
    except Exception as error:  # the constructor's own refusal
        raise ConfigError(f"data.dataset ({data_target}): {cli.first_line(error)}") from None
    try:
        return plainstep.data_size(dataset, f"data.dataset ({data_target})")
    except ValueError as error:
        raise ConfigError(cli.first_line(error)) from None


def validate_command(cfg: Mapping[str, Any], experiment: str | None, command: str) -> None:
    """Refuse a job that another command runs: an experiment whose config names its command
    (``run_by``, e.g. a script that trains outside ``python -m gatherlab.train``) runs only there,
    so that no command silently runs something else under the experiment's name."""
    run_by = cfg.get("run_by")
    if run_by is not None and run_by != command:
        raise ConfigError(
            f"experiment={experiment} is run by '{run_by}', not by '{command}'; allowed: {run_by}"
        )


@functools.lru_cache(maxsize=16)
def _dataset_size(dataset_yaml: str) -> int:
    """The number of samples of a data set config, which is built once per distinct config and
    checked against the contract: ``len``, and items ``(view0, view1[, key])`` for a key
    ``(epoch, index)``."""
    dataset = config.instantiate("data", OmegaConf.create(dataset_yaml))
    try:
        size = len(dataset)
        item = dataset[(0, 0)]
    except Exception as error:
        raise ConfigError(
            f"data ({type(dataset).__name__}) breaks the data set contract: {error}; allowed: "
            "len(data set) and data set[(epoch, index)] (docs/design.md §4)"
        ) from None
    if not isinstance(item, tuple | list) or len(item) not in (2, 3):
        raise ConfigError(
            f"data ({type(dataset).__name__}) items are {type(item).__name__} of "
            f"{len(item) if hasattr(item, '__len__') else '?'}; allowed: (view0, view1) or "
            "(view0, view1, key) (docs/design.md §4)"
        )
    return size


def _validate_objects(cfg: DictConfig) -> None:
    """Build the job's model, gather, loss and optimizer; their constructors' refusals and broken
    contracts become one line."""
    model = config.build_model(cfg)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model ({cfg.model._target_}) built a {type(model).__name__}; allowed: a "
            "torch.nn.Module (docs/design.md §4)"
        )
    gather = config.build_gather(cfg)  # None: gather=native
    if gather is not None and not callable(gather):
        raise ConfigError(
            f"gather ({cfg.gather._target_}) built a {type(gather).__name__}; allowed: a "
            "callable tensor -> gathered tensor (docs/design.md §4)"
        )
    # Built here as on one device (rank 0 of 1); each rank builds its own when it trains.
    factory = config.loss_factory(cfg)
    try:
        loss = factory()
    except Exception as error:  # the constructor's own refusal, e.g. temperature=0
        raise ConfigError(f"loss ({cfg.loss._target_}): {cli.first_line(error)}") from None
    if not isinstance(loss, torch.nn.Module):
        raise ConfigError(
            f"loss ({cfg.loss._target_}) built a {type(loss).__name__}; allowed: a "
            "torch.nn.Module whose forward(out0, out1) returns a scalar (docs/design.md §4)"
        )
    try:
        measure.style(factory)  # the style a loss declares is one of docs/design.md §1
    except ValueError as error:
        raise ConfigError(f"loss ({cfg.loss._target_}): {error}") from None
    optimizer = config.build_optimizer(cfg)
    stand_in = torch.nn.Parameter(torch.zeros(1))
    try:
        optimizer([stand_in])
    except Exception as error:  # the optimizer's own refusal, e.g. a negative learning rate
        raise ConfigError(f"optim ({cfg.optim._target_}): {error}") from None


def machine_warning(cfg: Mapping[str, Any]) -> str | None:
    """A warning, not an error: more CPU ranks than this machine has cores run, sharing them."""
    if cfg["layout"]["accelerator"] != terms.Accelerator.CPU:
        return None
    ranks, cores = cfg["layout"]["devices"], len(os.sched_getaffinity(0))
    if ranks <= cores:
        return None
    return (
        f"layout.devices={ranks} CPU ranks on {cores} core(s): they share the cores; the "
        "results are the same, the run is slower"
    )
