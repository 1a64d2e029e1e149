"""The options of the check cannot drift: each form's options are one typed dataclass
(`gatherlab.check.options`: `TrainingOptions`, `LossOptions`, `GatherOptions`), whose fields
`check_training`, ``python -m gatherlab.check`` and `assert_training_invariant` all read; each
refuses a bad value in ``__post_init__`` with one line; and what the loss check trains, stated in
Python (`defaults.LossSetting`), is what the lab's gradient audit composes (no ranks run here)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields

import pytest

from gatherlab import check, testing
from gatherlab.check import __main__ as command
from gatherlab.check import api, defaults, diagnosis, options
from gatherlab.check.table import CheckResult

OPTIONS = fields(options.TrainingOptions)
ON_THE_COMMAND_LINE = [option for option in OPTIONS if option.metadata["flag"]]
# the value the command line gives each kind of option, and what the options then hold
SAMPLES = {
    "ints": ("3,5", (3, 5)), "int": ("7", 7), "float": ("2.5", 2.5),
    "json": ('{"k": 1}', {"k": 1}), "text": ("pkg.mod:attr", "pkg.mod:attr"),
}  # fmt: skip
# the options whose sample must be one the options allow together: a whole update's layouts
ALLOWED = {
    "strategy": ("ddp", "ddp"), "precision": ("32-true", "32-true"),
    "world_sizes": ("2,4", (2, 4)), "micro_batches": ("1,2", (1, 2)),
    "global_batch_size": ("8", 8), "expert_parallel": ("2", 2), "judge_in": ("floors", "floors"),
}  # fmt: skip
A_STEP = {"step": "pkg.mod:step", "model": "pkg.mod:model", "data": "pkg.mod:Data"}


@pytest.mark.parametrize("kind", [options.TrainingOptions, options.LossOptions,
                                  options.GatherOptions])  # fmt: skip
def test_every_field_is_typed_and_documented_once(kind):
    hints = typing.get_type_hints(kind)
    for option in fields(kind):
        assert hints[option.name] is not typing.Any or option.name == "inputs", option.name
        assert option.metadata["doc"], option.name
        assert f"{option.name}: " in kind.__doc__  # help(kind) lists it


def test_the_command_line_has_an_option_for_each_field_but_the_seed():
    assert {option.name for option in OPTIONS} - {o.name for o in ON_THE_COMMAND_LINE} == {"seed"}
    parser = command._parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for option in ON_THE_COMMAND_LINE:
        action = by_flag[option.metadata["flag"]]
        assert action.dest == options.dest(option)
        assert action.default == option.metadata.get("cli_default", option.default)
    training = next(g for g in parser._action_groups if g.title == options.TRAINING)
    assert {action.dest for action in training._group_actions} == {
        options.dest(o) for o in ON_THE_COMMAND_LINE if o.metadata["group"] == options.TRAINING
    }


@pytest.fixture
def received(monkeypatch) -> dict:
    """What `check_training` is called with (nothing runs): its arguments."""
    calls: dict = {}

    def check_training(*args, **kwargs):
        calls.update(kwargs, positional=args)
        return CheckResult(None)

    monkeypatch.setattr(api, "check_training", check_training)
    monkeypatch.setattr(check, "check_training", check_training, raising=False)
    monkeypatch.setattr(diagnosis, "explain_training", lambda result: "")
    monkeypatch.setattr(check, "trains_like_one_device", lambda result: True, raising=False)
    return calls


def test_the_command_line_passes_every_option_to_check_training(received):
    argv, expected = [], {}
    for option in ON_THE_COMMAND_LINE:
        # one form: an update; one mesh of the ranks (the pipeline's option: test_pipeline.py);
        # context parallelism is refused whatever its degree (below)
        if option.name in ("module", "step", "tensor_parallel", "pipeline_parallel",
                           "context_parallel"):  # fmt: skip
            continue
        text, value = SAMPLES[option.metadata.get("kind", "text")]
        text, value = ALLOWED.get(option.name, (text, value))
        argv += [option.metadata["flag"], text]
        expected[option.name] = value
    command._check(command._parser().parse_args(argv))
    given = received.pop("options")
    assert received == {"positional": ()}
    assert {name: getattr(given, name) for name in expected} == expected


def test_the_command_line_without_options_passes_the_options_defaults(received):
    command._check(command._parser().parse_args(["--module", "pkg.mod:M", "--data", "d:D"]))
    given = received["options"]
    for option in OPTIONS:
        if option.name not in ("module", "data"):
            assert getattr(given, option.name) == option.default, option.name


def test_keywords_and_an_options_object_are_the_same_check(received):
    keywords = {"steps": 3, "world_sizes": (2,), "global_batch_size": 8, **A_STEP}
    testing.assert_training_invariant(**keywords)
    rest = {k: v for k, v in keywords.items() if k not in ("data", "world_sizes")}
    assert received == {"positional": (None, "pkg.mod:Data", (2,)), "options": None, **rest}
    made = options.TrainingOptions(**keywords)
    assert api._options(options.TrainingOptions, None, None, keywords) == made
    assert api._options(options.TrainingOptions, made, (4,), {"steps": 5}) == (
        dataclasses.replace(made, world_sizes=(4,), steps=5)
    )
    with pytest.raises(options.CheckError, match=r"^options=LossOptions\(...\) is not allowed"):
        api._options(options.TrainingOptions, options.LossOptions(), None, {})
    with pytest.raises(options.CheckError, match=r"allowed: GatherOptions$"):  # its gather unused
        api._options(options.GatherOptions, options.LossOptions(gather="old"), None, {})


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ({"data": "d:D"}, "name one of a LightningModule (--module), a plain PyTorch step"),
        ({**A_STEP, "module": "m:M"}, "--module and --step are forms of one check"),
        ({"module": "m:M"}, "--module needs --data (a map-style data set, module:attribute)"),
        ({"step": "s:s", "data": "d:D"}, "--step needs --model (a function or class returning"),
        ({**A_STEP, "micro_batches": (2,)}, "--micro-batches 2: micro-batches are the whole "
         "update's (--update); allowed: --update with them, or 1"),
        ({**A_STEP, "world_sizes": (0,)}, "world_sizes=(0,) (--world-sizes) is not allowed; "
         "allowed: integers ≥ 2"),
        ({**A_STEP, "step_budget_s": 0}, "--step-budget 0; allowed: a number of seconds > 0"),
        ({**A_STEP, "collective_timeout_s": -1}, "collective_timeout_s=-1 (--collective-timeout); "
         "allowed: a number of seconds > 0"),
        ({**A_STEP, "strategy": "fsdp2"}, "--strategy fsdp2: allowed: ddp, fsdp2 with --module"),
        ({**A_STEP, "precision": "8-true"}, "--precision '8-true' is not allowed; allowed: "),
        ({**A_STEP, "steps": -1}, "--steps -1 is not allowed; allowed: a positive integer"),
        ({**A_STEP, "global_batch_size": -4}, "--global-batch-size -4 is not allowed; allowed: a "
         "positive integer"),
        ({**A_STEP, "world_sizes": (3,)}, "world size 3 does not divide --global-batch-size 32; "
         "allowed: divisors of 32"),
        ({**A_STEP, "world_sizes": (1,)}, "world_sizes=(1,) (--world-sizes) is not allowed; "
         "allowed: integers ≥ 2"),
        ({**A_STEP, "step": None, "update": "u:u", "micro_batches": (3,)}, "--micro-batches 3 "
         "does not divide the 16 rows of each of 2 ranks (--global-batch-size 32); allowed: W × K "
         "dividing 32"),
        ({**A_STEP, "step": None, "update": "u:u", "world_sizes": (1,)}, "--world-sizes 1 with "
         "--micro-batches 1 is the reference itself"),
        ({**A_STEP, "tensor_parallel": 1}, "--tensor-parallel 1 is not allowed; allowed: an "
         "integer ≥ 2"),
        ({**A_STEP, "tensor_parallel": 4, "world_sizes": (2, 4)}, "--tensor-parallel 4 does not "
         "divide --world-sizes 2,4 (W = 2): a layout's mesh is W/T × T ranks; allowed: a T "
         "dividing every W (2)"),
        ({**A_STEP, "context_parallel": 2}, "--context-parallel 2: context parallelism does not "
         "run on a CPU, where the check's ranks run: torch 2.13's context_parallel has no "
         "sharding strategy for the CPU's scaled-dot-product attention "
         "(aten._scaled_dot_product_flash_attention_for_cpu); allowed: no --context-parallel "
         "(the sequence's shards of tensor parallelism: --tensor-parallel)"),
        ({**A_STEP, "context_parallel": 1.5}, "--context-parallel 1.5 is not allowed; allowed: an "
         "integer ≥ 2"),
    ],
)  # fmt: skip
def test_a_bad_training_option_is_one_line_when_the_options_are_made(given, line):
    with pytest.raises(options.CheckError) as refused:
        options.TrainingOptions(**given)
    assert line in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ({"optim": "lbfgs"}, "--optim 'lbfgs' is unknown; allowed: sgd, adamw"),
        ({"steps": -1}, "--steps -1 is not allowed; allowed: an integer ≥ 0"),
        ({"world_sizes": (1,)}, "world_sizes=(1,) (--world-sizes) is not allowed; allowed: "
         "integers ≥ 2"),
        ({"world_sizes": "2,4"}, "world_sizes='2,4' (--world-sizes) is not allowed"),
        ({"world_sizes": (2, 3)}, "world size 3 does not divide the global batch of 16; allowed: "
         "divisors of 16"),
    ],
)  # fmt: skip
def test_a_bad_loss_option_is_one_line_when_the_options_are_made(given, line):
    for kind in (options.GatherOptions, options.LossOptions):
        with pytest.raises(options.CheckError) as refused:
            kind(**given)
        assert str(refused.value).startswith(line), str(refused.value)


def test_a_keyword_that_is_no_option_is_named_with_what_is_allowed():
    with pytest.raises(options.CheckError) as refused:
        api.check_gather("fixed", optimiser="sgd")
    assert str(refused.value).startswith("GatherOptions: optimiser= is no option; allowed: ")
    with pytest.raises(options.CheckError, match=r"^TrainingOptions: model_kwarg= is no option"):
        api.check_training(**A_STEP, model_kwarg={})


def test_the_options_are_frozen_and_replaced_whole():
    chosen = options.TrainingOptions(**A_STEP)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.steps = 3
    assert dataclasses.replace(chosen, steps=3).steps == 3
    with pytest.raises(options.CheckError, match="--step-budget"):
        dataclasses.replace(chosen, step_budget_s=-1.0)


@pytest.mark.parametrize("optim", defaults.OPTIMIZERS)
def test_the_loss_checks_setting_is_the_gradient_audits(optim):
    """`defaults.LossSetting` states in Python what the lab's ``experiment=gather_audit`` composes
    (the audit and the loss check measure the same thing): the same model, data, batch, seed,
    optimizers and style losses."""
    import torch

    from gatherlab.components import config

    with config.composed():
        cfg, _ = config.compose(["experiment=gather_audit", f"optim={optim}"])
    setting = defaults.LOSS_SETTING
    model, optimizer, data = api._built(optim)
    composed = config.instantiate("model", cfg.model, _partial_=True, _convert_="all")
    assert (model.func, model.keywords) == (composed.func, composed.keywords)
    composed = config.build_optimizer(cfg)
    assert (optimizer.func, optimizer.keywords) == (composed.func, composed.keywords)
    composed = config.build_dataset(cfg)
    assert len(data) == len(composed)
    for index in range(len(data)):
        assert all(torch.equal(a, b) for a, b in zip(data[index], composed[index], strict=True))
    assert (setting.global_batch_size, setting.seed, setting.shuffle) == (
        cfg.global_batch_size, cfg.seed, cfg.data.shuffle,
    )  # fmt: skip
    assert cfg.precision == "64-true"  # the loss form trains in float64
    assert tuple(cfg.audit.losses) == api.STYLE_LOSSES
    for name, target, kwargs in setting.style_losses:
        recipe = config.loss_factory_of(cfg.audit.losses[name], None, 0)
        assert (recipe.factory, dict(recipe.kwargs)) == (api.locate(target), kwargs)


def test_context_parallelism_still_cannot_run_on_a_cpu():
    """The reason `options.CONTEXT_PARALLEL_ON_CPU` gives, measured: torch's ring attention over a
    CPU mesh (one rank of gloo in this process: the sharding rule is looked up before any rank
    is sent anything) raises for the CPU's attention kernel. Once torch can, this fails, and the
    refusal is to be replaced by a check of context parallelism."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
        sharded = context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])
        with pytest.raises(NotImplementedError) as raised, sharded:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        dist.destroy_process_group()
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(raised.value)
    assert "does not have a sharding strategy" in str(raised.value)
    assert torch.__version__.startswith("2.13")  # the version the refusal names
