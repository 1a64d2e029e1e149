"""The options of the check of a training step cannot drift: `check_training`'s keyword arguments,
``python -m gatherlab.check``'s options and `assert_training_invariant`'s are the fields of one
spec, `gatherlab.check.defaults.TrainingOptions`; and what the loss check trains, stated in Python
(`defaults.LossSetting`), is what the lab's gradient audit composes (no ranks run here)."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pandas as pd
import pytest

from gatherlab import check, testing
from gatherlab.check import __main__ as command
from gatherlab.check import api, defaults, diagnosis

OPTIONS = fields(defaults.TrainingOptions)
ON_THE_COMMAND_LINE = [option for option in OPTIONS if option.metadata["flag"]]
# the value the command line gives each kind of option, and what check_training then receives
SAMPLES = {
    "ints": ("3,5", (3, 5)), "int": ("7", 7), "float": ("2.5", 2.5),
    "json": ('{"k": 1}', {"k": 1}), "text": ("pkg.mod:attr", "pkg.mod:attr"),
}  # fmt: skip


def test_check_training_takes_the_spec_fields_in_order_with_their_defaults():
    parameters = list(inspect.signature(api.check_training).parameters.values())
    assert [(p.name, p.default) for p in parameters] == [(o.name, o.default) for o in OPTIONS]
    kinds = [p.kind for p in parameters]
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3 + [
        inspect.Parameter.KEYWORD_ONLY
    ] * (len(OPTIONS) - 3)
    assert all(option.metadata["doc"] for option in OPTIONS)  # each documented once, there


def test_the_command_line_has_an_option_for_each_field_but_the_seed():
    assert {option.name for option in OPTIONS} - {o.name for o in ON_THE_COMMAND_LINE} == {"seed"}
    parser = command._parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for option in ON_THE_COMMAND_LINE:
        action = by_flag[option.metadata["flag"]]
        assert action.dest == defaults.dest(option)
        assert action.default == option.metadata.get("cli_default", option.default)
    training = next(g for g in parser._action_groups if g.title == defaults.TRAINING)
    assert {action.dest for action in training._group_actions} == {
        defaults.dest(o) for o in ON_THE_COMMAND_LINE if o.metadata["group"] == defaults.TRAINING
    }


@pytest.fixture
def received(monkeypatch) -> dict:
    """What `check_training` is called with (nothing runs): its keyword arguments."""
    calls: dict = {}

    def check_training(*args, **kwargs):
        calls.update(kwargs, positional=args)
        return pd.DataFrame()

    monkeypatch.setattr(api, "check_training", check_training)
    monkeypatch.setattr(check, "check_training", check_training, raising=False)
    monkeypatch.setattr(diagnosis, "explain_training", lambda table: "")
    monkeypatch.setattr(check, "trains_like_one_device", lambda table: True, raising=False)
    return calls


def test_the_command_line_passes_every_option_to_check_training(received):
    argv, expected = [], {}
    for option in ON_THE_COMMAND_LINE:
        text, value = SAMPLES[option.metadata.get("kind", "text")]
        argv += [option.metadata["flag"], text]
        expected[option.name] = value
    command._check(command._parser().parse_args(argv))
    assert received == {**expected, "positional": ()}


def test_the_command_line_without_options_passes_check_trainings_defaults(received):
    command._check(command._parser().parse_args(["--module", "pkg.mod:M"]))
    for option in ON_THE_COMMAND_LINE:
        if option.name not in ("module", "world_sizes"):
            assert received[option.name] == option.default
    assert received["world_sizes"] is None  # main() puts defaults.WORLD_SIZES, or the launcher's


def test_assert_training_invariant_names_and_passes_every_keyword_argument(received):
    for option in OPTIONS[3:]:
        assert f"``{option.name}=``" in testing.assert_training_invariant.__doc__
    arguments = {option.name: object() for option in OPTIONS[3:]}
    testing.assert_training_invariant("m:M", "d:D", (2,), **arguments)
    assert received == {**arguments, "positional": ("m:M", "d:D", (2,))}


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
