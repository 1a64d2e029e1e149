"""Each gather on real 2- and 4-rank gloo groups: forward equals torch.cat of the ranks' tensors;
the input gradients of the exact gathers equal the single-device gradients, ``old``'s do not; on a
linear loss every gather's per-rank gradient equals its closed form (docs/design.md §1's table);
``old`` equals the own-slice pattern (examples/standins.py: a gather whose backward keeps the own
slice, the pattern of lightly's GatherLayer before PR #1531) bit for bit.
The backward collectives a GPU runs (``fixed``'s and ``avg``'s reduce-scatter, torch's
reduce-scatter under ``torch_nn`` and ``lightning``) on gloo at W = 2, 4, 8; the backend →
collective choice; a bad ``collective=``. The names are the YAML files of conf/gather/ (the one
registry of gathers), in the order of ``IMPLEMENTATIONS``, which holds every gather class of the
package in the order of docs/design.md §1's table. (The parameter-gradient class of every gather
is the audit's, tests/lab/test_audit.py.)"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import REPO
from standins import OwnSliceGather, Pre1531NTXent

from gatherlab import gather
from gatherlab.analysis import figures
from gatherlab.losses import NTXentGlobalLoss, NTXentLoss
from gatherlab.ranks import pool as pools

BATCH, DIM = 3, 4
# Float64 results that differ only in summation order agree to a few ulps (~1e-16 relative).
EXACT = 1e-12
# The own-slice pattern, written independently of gatherlab.gather (examples/standins.py), run
# beside the gathers.
PRE1531 = "own_slice_standin"


def _gathers_on_ranks() -> dict[str, gather.GatherFn]:
    return {**{name: gather.get(name) for name in gather.NAMES}, PRE1531: OwnSliceGather.apply}


def _global_batch(world_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(world_size * BATCH, DIM, generator=generator, dtype=torch.float64)


def _linear_loss_weights(world_size: int) -> torch.Tensor:
    """c_r of the linear local loss L_r = <c_r, Z>: one (N, D) weight per rank."""
    generator = torch.Generator().manual_seed(2)
    return torch.randn(
        world_size, world_size * BATCH, DIM, generator=generator, dtype=torch.float64
    )


def _own_rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * BATCH : (rank + 1) * BATCH].clone().requires_grad_()


def _backward(loss: torch.Tensor) -> None:
    if loss.requires_grad:  # not with ``nograd`` when every use of the input is gathered
        loss.backward()


def _grad(x: torch.Tensor) -> torch.Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)


def _per_rank_case(world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """On every rank, for every gather (and the own-slice stand-in, `PRE1531`): the gathered
    tensor and the local input gradients of a linear local-loss (L_r = <c_r, Z>), NT-Xent (local)
    and NT-Xent (global); and the stand-in's own local-style NT-Xent on that gather."""
    rank = torch.distributed.get_rank()
    features0, features1 = _global_batch(world_size, 0), _global_batch(world_size, 1)
    weights = _linear_loss_weights(world_size)
    outcome = {}
    for name, gather_fn in _gathers_on_ranks().items():
        x = _own_rows(features0, rank)
        gathered = gather_fn(x)
        _backward((weights[rank] * gathered).sum())
        result = {"gathered": gathered.detach(), "linear_grad": _grad(x)}
        for key, loss_class in (("ntxent", NTXentLoss), ("ntxent_global", NTXentGlobalLoss)):
            out0, out1 = _own_rows(features0, rank), _own_rows(features1, rank)
            loss = loss_class(gather=gather_fn)(out0, out1)
            _backward(loss)
            result[f"{key}_loss"] = loss.detach()
            result[f"{key}_grad"] = torch.cat([_grad(out0), _grad(out1)], dim=1)
        outcome[name] = result
    out0, out1 = _own_rows(features0, rank), _own_rows(features1, rank)
    loss = Pre1531NTXent(temperature=0.5)(out0, out1)  # its own NT-Xent, not gatherlab's
    loss.backward()
    outcome[PRE1531]["standin_ntxent_loss"] = loss.detach()
    outcome[PRE1531]["standin_ntxent_grad"] = torch.cat([out0.grad, out1.grad], dim=1)
    return outcome


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def ranks(request) -> tuple[int, list[dict]]:
    return request.param, pools.pool(request.param).run(_per_rank_case, request.param)


def _single_device(world_size: int) -> dict[str, torch.Tensor]:
    """The same losses on one device over the whole batch; gradients of the mean of the ranks'
    losses, which is what DDP's 1/W average of the parameter gradients corresponds to."""
    features0, features1 = _global_batch(world_size, 0), _global_batch(world_size, 1)
    weights = _linear_loss_weights(world_size)
    reference = {"gathered": features0, "linear_grad": weights.mean(dim=0)}
    for key, loss_class in (("ntxent", NTXentLoss), ("ntxent_global", NTXentGlobalLoss)):
        out0, out1 = features0.clone().requires_grad_(), features1.clone().requires_grad_()
        loss = loss_class(gather=None)(out0, out1)
        loss.backward()
        reference[f"{key}_loss"] = loss.detach()
        reference[f"{key}_grad"] = torch.cat([out0.grad, out1.grad], dim=1)
    return reference


def _assert_relatively_equal(measured: torch.Tensor, expected: torch.Tensor) -> None:
    """max |measured − expected| ≤ `EXACT` · max |expected|: equal up to the order of float64
    sums, relative to the gradient's size (an absolute bound would be loose on small gradients)."""
    scale = float(expected.abs().max())
    assert scale > 0
    difference = float((measured - expected).abs().max())
    assert difference <= EXACT * scale, f"max |Δ| {difference:.3g} against max |g| {scale:.3g}"


def _rank_grads(per_rank: list[dict], name: str, key: str) -> torch.Tensor:
    """The ranks' local gradients stacked in rank order, divided by W as DDP averages them."""
    return torch.cat([outcome[name][key] for outcome in per_rank]) / len(per_rank)


@pytest.mark.parametrize("name", gather.NAMES)
def test_forward_is_concatenation_in_rank_order(ranks, name):
    world_size, per_rank = ranks
    expected = _global_batch(world_size, 0)
    for outcome in per_rank:
        assert torch.equal(outcome[name]["gathered"], expected)


@pytest.mark.parametrize("name", ["fixed", "torch_nn", "functional", "lightning"])
@pytest.mark.parametrize("key", ["linear_grad", "ntxent_grad", "ntxent_global_grad"])
def test_exact_gathers_give_single_device_gradients(ranks, name, key):
    world_size, per_rank = ranks
    expected = _single_device(world_size)[key]
    _assert_relatively_equal(_rank_grads(per_rank, name, key), expected)


def test_nograd_passes_no_gradient_through_the_gather(ranks):
    _, per_rank = ranks
    for outcome in per_rank:
        assert not outcome["nograd"]["linear_grad"].any()
        assert not outcome["nograd"]["ntxent_global_grad"].any()
        assert outcome["nograd"]["ntxent_grad"].abs().max() > 0  # the local rows' direct use


@pytest.mark.parametrize("key", ["ntxent_loss", "ntxent_global_loss"])
def test_mean_of_rank_losses_is_single_device_loss(ranks, key):
    world_size, per_rank = ranks
    expected = _single_device(world_size)[key]
    for name in gather.NAMES:
        mean = torch.stack([outcome[name][key] for outcome in per_rank]).mean()
        assert abs(float(mean - expected)) <= EXACT


@pytest.mark.parametrize("name", ["old", "nograd_swap", "avg"])
@pytest.mark.parametrize("key", ["linear_grad", "ntxent_grad"])
def test_inexact_gathers_miss_cross_rank_gradients(ranks, name, key):
    world_size, per_rank = ranks
    expected = _single_device(world_size)[key]
    error = (_rank_grads(per_rank, name, key) - expected).abs().max()
    assert error > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("name", ["old", "nograd_swap", "avg"])
def test_one_over_w_on_global_loss(ranks, name):
    """On a loss every rank computes in full, these return exactly 1/W of the gradient."""
    world_size, per_rank = ranks
    expected = _single_device(world_size)["ntxent_global_grad"]
    measured = _rank_grads(per_rank, name, "ntxent_global_grad")
    assert torch.allclose(measured * world_size, expected, rtol=0, atol=EXACT)
    assert not torch.allclose(measured, expected, rtol=0, atol=1e-3)


# The backward of each gather on the linear loss L_r = <C_r, Z>, whose gradient at the gathered
# output of rank r is G_r = C_r: what rank s gets for its rows, b_s of docs/design.md §1's table
# ("sum": Σ_r G_r[s], "own": G_s[s], "mean": (1/W) Σ_r G_r[s], "none": nothing). Stated here from
# the table, not read from the gathers' declared ``backward``.
BACKWARD_RULE = {
    "fixed": "sum", "fixed_all_reduce": "sum", "fixed_reduce_scatter": "sum", "torch_nn": "sum",
    "functional": "sum", "lightning": "sum", "old": "own", "nograd_swap": "own", "avg": "mean",
    "nograd": "none", PRE1531: "own",
}  # fmt: skip


def _closed_form(rule: str, weights: torch.Tensor, rank: int) -> torch.Tensor:
    """b_s of ``rule`` on rank ``rank`` for the linear loss, from the C_r alone (plain torch)."""
    world_size = weights.shape[0]
    slices = weights[:, rank * BATCH : (rank + 1) * BATCH]  # C_r[s] for every r
    return {
        "sum": lambda: slices.sum(dim=0),
        "own": lambda: slices[rank].clone(),
        "mean": lambda: slices.sum(dim=0) / world_size,
        "none": lambda: torch.zeros_like(slices[rank]),
    }[rule]()


# The entries of C_r are standard normal draws (|C| < 6 here); any order of summing W ≤ 8 of them in
# float64 rounds by at most W · 6 · 2^-52 ≈ 1e-14, so 1e-12 absolute is a few ulps' room, ~1e9
# below the smallest wrong answer (a dropped C_r[s], a factor W).
SUMMATION_ORDER = 1e-12


def _assert_closed_form(rule: str, measured: torch.Tensor, expected: torch.Tensor) -> None:
    if rule in ("own", "none"):  # a copy of one slice, or nothing: no arithmetic, bit for bit
        assert torch.equal(measured, expected)
    else:
        torch.testing.assert_close(measured, expected, rtol=0, atol=SUMMATION_ORDER)


@pytest.mark.parametrize("name", [*gather.NAMES, PRE1531])
def test_linear_loss_gradient_is_the_closed_form_of_each_backward(ranks, name):
    """Per rank, not averaged: ``old`` and ``nograd_swap`` hand back C_s[s] only, ``avg`` the mean
    Σ_r C_r[s] / W, ``nograd`` nothing, the exact gathers the sum Σ_r C_r[s]."""
    world_size, per_rank = ranks
    weights = _linear_loss_weights(world_size)
    rule = BACKWARD_RULE[name]
    for rank, outcome in enumerate(per_rank):
        expected = _closed_form(rule, weights, rank)
        _assert_closed_form(rule, outcome[name]["linear_grad"], expected)
    assert BACKWARD_RULE.keys() == {*gather.NAMES, PRE1531}  # every built-in gather has its rule


@pytest.mark.parametrize("key", ["linear_grad", "ntxent_grad", "ntxent_global_grad"])
def test_old_is_the_own_slice_pattern_bit_for_bit(ranks, key):
    """gatherlab's ``old`` against the own-slice stand-in (examples/standins.py: its backward keeps
    the own slice, written apart from gatherlab.gather), in the same losses on the same real ranks:
    the same numbers, bit for bit (both copy one slice of the same gradient)."""
    _, per_rank = ranks
    for outcome in per_rank:
        assert torch.equal(outcome["old"][key], outcome[PRE1531][key])
        assert torch.equal(outcome["old"]["gathered"], outcome[PRE1531]["gathered"])


def test_old_gives_the_local_style_ntxent_of_the_own_slice_pattern(ranks):
    """The stand-ins' local-style NT-Xent (the pattern of lightly's NTXentLoss: own rows against
    gathered columns) on the own-slice gather, against gatherlab's NT-Xent with ``old``: the same
    loss and local gradients per rank up to the order of float64 sums (the stand-in drops the
    self-similarities, gatherlab masks them with -inf)."""
    _, per_rank = ranks
    for outcome in per_rank:
        expected, standin = outcome["old"], outcome[PRE1531]
        scale = float(expected["ntxent_grad"].abs().max())
        difference = float((standin["standin_ntxent_grad"] - expected["ntxent_grad"]).abs().max())
        assert difference <= EXACT * scale
        loss_difference = abs(float(standin["standin_ntxent_loss"] - expected["ntxent_loss"]))
        assert loss_difference <= EXACT * abs(float(expected["ntxent_loss"]))


def test_without_process_group_every_gather_is_the_identity():
    x = torch.randn(BATCH, DIM)
    for name in gather.NAMES:
        assert gather.get(name)(x) is x


# The options of conf/gather/ but native, in the order of docs/design.md §1's table (each class
# of gatherlab.gather in the order it defines them, the options of one class by name).
SHIPPED = (
    "fixed", "fixed_all_reduce", "fixed_reduce_scatter", "torch_nn", "functional", "lightning",
    "old", "nograd_swap", "avg", "nograd",
)  # fmt: skip


def test_the_names_are_the_yaml_files_of_the_gather_group():
    """``conf/gather/*.yaml`` is the registry: NAMES is its files but native, each gather is what
    its file names with the file's arguments."""
    files = {path.stem for path in (REPO / "conf" / "gather").glob("*.yaml")}
    assert set(gather.NAMES) == files - {"native"} and gather.NAMES == SHIPPED
    assert gather.get("fixed_all_reduce") == gather.Fixed("all_reduce")
    assert gather.get("fixed_reduce_scatter") == gather.Fixed("reduce_scatter")
    assert not hasattr(gather, "register")


def _classes_defined_in_the_package() -> set[type]:
    """Every `Gather` subclass a module of ``gatherlab.gather`` defines (imported, not read off
    the package face): what `gather.IMPLEMENTATIONS` must list."""
    import importlib
    import pkgutil

    defined = set()
    for module_info in pkgutil.iter_modules(gather.__path__, prefix=f"{gather.__name__}."):
        module = importlib.import_module(module_info.name)
        defined |= {
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, gather.Gather)
            and value is not gather.Gather
            and value.__module__ == module.__name__
        }
    return defined


def test_every_gather_class_of_the_package_has_its_place_in_the_order():
    """A class added to any file of ``gatherlab.gather`` and not to ``IMPLEMENTATIONS`` would be
    sorted after every other gather by ``ordered``, silently: it fails here instead."""
    assert len(gather.IMPLEMENTATIONS) == len(set(gather.IMPLEMENTATIONS)) == 8
    assert _classes_defined_in_the_package() == set(gather.IMPLEMENTATIONS)


def _design_table_names() -> list[str]:
    """The first column of docs/design.md §1's table "What each gather returns", top to bottom."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("### What each gather returns", 1)[1].split("\n\n", 2)[1]
    return [row.split("|")[1].strip().strip("`") for row in table.splitlines()[2:]]


def test_names_follow_the_order_of_the_classes_and_of_design_s_table():
    """``NAMES`` lists the options by the place of their class in ``IMPLEMENTATIONS`` (the options
    of one class by name), and that order is docs/design.md §1's table, one row per class."""
    place = {kind: index for index, kind in enumerate(gather.IMPLEMENTATIONS)}
    by_class = sorted(gather.NAMES, key=lambda name: (place[type(gather.get(name))], name))
    assert tuple(by_class) == gather.NAMES
    table = _design_table_names()
    assert table == ["fixed", "torch_nn", "functional", "lightning", "old", "nograd_swap", "avg",
                     "nograd"]  # fmt: skip
    assert [type(gather.get(name)) for name in table] == list(gather.IMPLEMENTATIONS)
    assert [name for name in gather.NAMES if name in table] == table


def test_unknown_gather_names_what_is_allowed():
    allowed = ", ".join(SHIPPED)
    with pytest.raises(ValueError) as error:
        gather.get("nope")
    assert str(error.value) == f"gather='nope' is unknown; allowed: {allowed}"
    with pytest.raises(ValueError) as error:
        gather.resolve("native")  # an option of the group, but no gather
    assert str(error.value) == (
        "gather='native' is no gather: the loss communicates by itself (its YAML file has "
        f"_target_: null); allowed: {allowed}"
    )


def test_every_gather_gatherlab_ships_has_its_own_colour():
    """The figures' colours are a style table keyed by name: one per option of the group, no name
    that is none, no colour twice, none shared with the colours of a user's gathers."""
    assert set(figures.GATHER_COLORS) == set(gather.NAMES)
    colours = list(figures.GATHER_COLORS.values())
    assert len(set(colours)) == len(colours)
    assert not set(colours) & set(figures.OTHER_GATHER_COLORS)


# The backward collectives a GPU takes, run on gloo. ``fixed`` and ``avg`` choose theirs by
# ``gather.backward_collective()``, torch's ``all_gather`` (under ``torch_nn`` and ``lightning``)
# by ``dist.get_backend()``: reduce-scatter on NCCL and XCCL. gloo in torch 2.13 runs every
# collective of those branches, so a variant marked "@nccl" runs on ranks whose
# ``torch.distributed.get_backend`` reports "nccl": the choice is NCCL's, every collective is
# gloo's, for real. Only the name is faked; nothing that moves or sums a number is.
SPIED = ("all_reduce", "reduce_scatter_single", "reduce_scatter", "scatter")
"""The backward collectives of the gathers (gloo's all-to-all under torch_nn is W scatters)."""
COLLECTIVE_VARIANTS = {
    # name: (gather, backend reported by torch.distributed.get_backend or None for the real one,
    #        the collectives its backward calls)
    "fixed": (lambda: gather.Fixed(), None, {"all_reduce"}),
    "fixed[all_reduce]": (lambda: gather.Fixed("all_reduce"), None, {"all_reduce"}),
    "fixed[reduce_scatter]": (
        lambda: gather.Fixed("reduce_scatter"),
        None,
        {"reduce_scatter_single"},
    ),
    "fixed@nccl": (lambda: gather.Fixed(), "nccl", {"reduce_scatter_single"}),
    "avg": (lambda: gather.Avg(), None, {"all_reduce"}),
    "avg@nccl": (lambda: gather.Avg(), "nccl", {"reduce_scatter_single"}),
    "torch_nn": (lambda: gather.TorchNN(), None, {"scatter"}),
    "torch_nn@nccl": (lambda: gather.TorchNN(), "nccl", {"reduce_scatter"}),
    "lightning@nccl": (lambda: gather.Lightning(), "nccl", {"reduce_scatter"}),
}
EXACT_VARIANTS = [name for name in COLLECTIVE_VARIANTS if not name.startswith("avg")]


@contextlib.contextmanager
def _backend_reported_as(backend: str | None) -> Iterator[None]:
    """``torch.distributed.get_backend`` reports ``backend`` (None: unchanged) inside."""
    if backend is None:
        yield
        return
    real = dist.get_backend
    dist.get_backend = lambda group=None: backend
    try:
        yield
    finally:
        dist.get_backend = real


@contextlib.contextmanager
def _collectives_called(called: set[str]) -> Iterator[None]:
    """Adds to ``called`` the name of every `SPIED` collective called through torch.distributed."""
    real = {name: getattr(dist, name) for name in SPIED}

    def spy(name):
        def call(*args, **kwargs):
            called.add(name)
            return real[name](*args, **kwargs)

        return call

    for name in SPIED:
        setattr(dist, name, spy(name))
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


def _per_rank_collectives(world_size: int) -> dict:
    """On every rank, for every variant of `COLLECTIVE_VARIANTS`: the collectives its backward
    calls on the linear local loss, and the local input gradients of that loss, NT-Xent (local)
    and NT-Xent (global); and the collective ``backward_collective`` picks, as is and as NCCL."""
    rank = torch.distributed.get_rank()
    features0, features1 = _global_batch(world_size, 0), _global_batch(world_size, 1)
    weights = _linear_loss_weights(world_size)
    outcome: dict = {"chosen": gather.backward_collective()}
    with _backend_reported_as("nccl"):
        outcome["chosen@nccl"] = gather.backward_collective()
    for name, (make, backend, _) in COLLECTIVE_VARIANTS.items():
        gather_fn, called = make(), set()
        with _backend_reported_as(backend):
            x = _own_rows(features0, rank)
            loss = (weights[rank] * gather_fn(x)).sum()
            with _collectives_called(called):
                loss.backward()
            result = {"called": called, "linear_grad": _grad(x)}
            for key, loss_class in (("ntxent", NTXentLoss), ("ntxent_global", NTXentGlobalLoss)):
                out0, out1 = _own_rows(features0, rank), _own_rows(features1, rank)
                loss_class(gather=gather_fn)(out0, out1).backward()
                result[f"{key}_grad"] = torch.cat([_grad(out0), _grad(out1)], dim=1)
        outcome[name] = result
    return outcome


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["W2", "W4", "W8"])
def collectives(request) -> tuple[int, list[dict]]:
    return request.param, pools.pool(request.param).run(_per_rank_collectives, request.param)


@pytest.mark.parametrize("name", COLLECTIVE_VARIANTS)
def test_each_backward_calls_its_collective(collectives, name):
    _, per_rank = collectives
    expected = COLLECTIVE_VARIANTS[name][2]
    for outcome in per_rank:
        assert outcome[name]["called"] == expected, name


def test_gloo_chooses_all_reduce_and_nccl_reduce_scatter_on_real_ranks(collectives):
    _, per_rank = collectives
    for outcome in per_rank:
        assert (outcome["chosen"], outcome["chosen@nccl"]) == ("all_reduce", "reduce_scatter")


@pytest.mark.parametrize("name", EXACT_VARIANTS)
@pytest.mark.parametrize("key", ["linear_grad", "ntxent_grad", "ntxent_global_grad"])
def test_every_backward_collective_gives_single_device_gradients(collectives, name, key):
    """``Fixed("reduce_scatter")`` (NCCL's, what every GPU user runs), ``Fixed("all_reduce")``
    and the others against one device, to 1e-12 relative."""
    world_size, per_rank = collectives
    expected = _single_device(world_size)[key]
    _assert_relatively_equal(_rank_grads(per_rank, name, key), expected)


@pytest.mark.parametrize("name", COLLECTIVE_VARIANTS)
def test_every_backward_collective_gives_the_closed_form_on_each_rank(collectives, name):
    """Per rank, on the linear loss: the sum Σ_r C_r[s] (``avg``: its mean), whichever collective
    delivers it."""
    world_size, per_rank = collectives
    weights = _linear_loss_weights(world_size)
    rule = "mean" if name.startswith("avg") else "sum"
    for rank, outcome in enumerate(per_rank):
        expected = _closed_form(rule, weights, rank)
        _assert_closed_form(rule, outcome[name]["linear_grad"], expected)


@pytest.mark.parametrize("key", ["linear_grad", "ntxent_grad", "ntxent_global_grad"])
def test_the_two_collectives_of_fixed_and_of_avg_agree(collectives, key):
    _, per_rank = collectives
    for a, b in (("fixed[all_reduce]", "fixed[reduce_scatter]"), ("avg", "avg@nccl")):
        assert torch.allclose(
            _rank_grads(per_rank, a, key), _rank_grads(per_rank, b, key), rtol=0, atol=EXACT
        ), (a, b)


def test_avg_on_nccl_s_collective_is_one_over_w_on_the_global_loss(collectives):
    world_size, per_rank = collectives
    expected = _single_device(world_size)["ntxent_global_grad"]
    measured = _rank_grads(per_rank, "avg@nccl", "ntxent_global_grad")
    assert torch.allclose(measured * world_size, expected, rtol=0, atol=EXACT)


def _what_gloo_reduce_scatter_runs() -> set[str]:
    """The operations torch records (its public profiler) inside one reduce-scatter on gloo."""
    from torch.profiler import ProfilerActivity, profile

    grad = torch.ones(2 * dist.get_world_size(), 3)
    own = grad.new_empty(2, 3)
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        dist.reduce_scatter_single(own, grad)
    return {event.name for event in recorded.events()}


def test_gloo_s_reduce_scatter_is_a_copy_and_an_all_reduce():
    """Why ``fixed`` all-reduces on gloo: torch's gloo reduce-scatter clones the whole gradient,
    all-reduces the clone and copies the own slice out, what ``fixed``'s all-reduce does and one
    copy more. If torch gives gloo a reduce-scatter of its own, this fails: time both again
    (``python -m gatherlab.bench gather``) before keeping the choice."""
    for recorded in pools.pool(2).run(_what_gloo_reduce_scatter_runs):
        assert {"c10d::_reduce_scatter_base_", "aten::clone", "gloo:all_reduce"} <= recorded


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("gloo", "all_reduce"),
        ("mpi", "all_reduce"),
        ("nccl", "reduce_scatter"),
        ("xccl", "reduce_scatter"),
    ],
)
def test_backward_collective_follows_the_backend(monkeypatch, backend, expected):
    """The choice alone, in one process: only the backend's name is needed to make it (the
    collectives themselves run for real on gloo in the tests above)."""
    assert gather.backward_collective(backend) == expected
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert gather.backward_collective() == expected


def test_a_bad_collective_is_refused_in_one_line():
    with pytest.raises(ValueError) as error:
        gather.Fixed(collective="bogus")
    assert str(error.value) == (
        "collective='bogus' is not allowed; allowed: all_reduce, reduce_scatter"
    )


# --- the order in which the gather benchmark runs them ------------------------------------------


@pytest.mark.parametrize("count", range(1, 10))
def test_the_benchmark_runs_every_gather_at_every_place_and_after_every_other_equally_often(count):
    """``python -m gatherlab.bench gather`` runs each round's gathers in ``balanced_orders``: over
    a cycle each gather is at every place of a round, and follows every other gather, equally
    often, so that no gather is always first (``fixed`` was, and measured slower than itself
    under another name, ``fixed_all_reduce``)."""
    from gatherlab.lab.bench import balanced_orders

    orders = balanced_orders(count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    places = Counter((order[place], place) for order in orders for place in range(count))
    assert len(places) == count * count and len(set(places.values())) == 1
    follows = Counter(pair for order in orders for pair in itertools.pairwise(order))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) <= 1
