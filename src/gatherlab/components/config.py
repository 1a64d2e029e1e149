"""From Hydra configs to objects: composing a job's config, expanding a sweep into its jobs, the
options of a config group, and building the objects a config names with ``_target_``.

This is the one module of the library that speaks Hydra; above it, only the lab's command lines
(``lab.train``, ``lab.preflight``, ``lab.sweepend``) and gatherlab's sweeper
(``hydra_plugins.gatherlab_sweeper``) do. Everything it builds is a plain Python object (a data
set, a model, a gather, a loss, an optimizer factory); the layers below it take those and know
nothing of configs. docs/design.md §4 lists the extension points.
"""

from __future__ import annotations

import importlib.resources
import inspect
import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
import torch
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, InstantiationException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict

from gatherlab.components.factory import Recipe
from gatherlab.components.sharding import Sharding
from gatherlab.core import cli
from gatherlab.core.imports import locate
from gatherlab.gather import ordered

# The configs: the repository's conf/, which the package carries as gatherlab.conf (pyproject.toml),
# so a checkout and an installed wheel compose the same files.
CONFIG_MODULE = "gatherlab.conf"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
CONFIG_NAME = "config"
# Where those files are on disk (conf/ in a checkout, site-packages/gatherlab/conf in a wheel).
CONFIG_DIR = Path(str(importlib.resources.files(CONFIG_MODULE)))


class ConfigError(ValueError):
    """A configuration value that cannot run; the message is one line that names the key, the
    value and what is allowed."""


@contextmanager
def composed() -> Iterator[None]:
    """The context in which ``compose`` and ``job_overrides`` read gatherlab's configs; inside a
    running Hydra app (which has its own) it adds nothing."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        yield


def compose(overrides: Sequence[str] = ()) -> tuple[DictConfig, dict[str, str | None]]:
    """The job config of ``overrides`` (without its ``hydra`` node) and its config group choices.

    Must run inside ``composed()``. An unknown option of a group, also of a group that a
    directory on ``hydra.searchpath`` adds to, is one line naming what is allowed.
    """
    cfg = compose_with_hydra(overrides)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


def compose_with_hydra(overrides: Sequence[str]) -> DictConfig:
    """The full config of ``overrides``, its ``hydra`` node included; Hydra's errors as one line."""
    return hydra_errors_as_one_line(
        hydra.compose, CONFIG_NAME, overrides=list(overrides), return_hydra_config=True
    )


def hydra_errors_as_one_line(compose: Callable[..., DictConfig], *args, **kwargs) -> DictConfig:
    """``compose(*args, **kwargs)``, a composition by Hydra, whose refusal raises ``ConfigError``
    (one line; an unknown option of a group names the options allowed)."""
    try:
        return compose(*args, **kwargs)
    except HydraException as error:
        raise _one_line(error) from None
    except yaml.YAMLError as error:  # a config file that is no YAML (PyYAML's, as OmegaConf's)
        raise ConfigError(_not_yaml(error)) from None


def _not_yaml(error: yaml.YAMLError) -> str:
    """A config file PyYAML cannot read, in one line: where, and what it found."""
    # the context (the key being read) where PyYAML gives one, else where it gave up
    mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
    problem = getattr(error, "problem", None) or cli.first_line(error)
    return f"{where} is not YAML ({problem}); allowed: one `key: value` per line"


def _one_line(error: HydraException) -> ConfigError:
    missing = getattr(error, "missing_cfg_file", None) or ""
    options = getattr(error, "options", None)
    unknown = re.match(r"Could not override '([^']+)'", str(error))
    if unknown:  # a key the config does not have: the keys it has there
        key = unknown.group(1)
        composed = getattr(error.__cause__, "parent_node", None)  # the chosen option's node
        keys = (sorted(str(k) for k in composed if k != "defaults")
                if isinstance(composed, DictConfig) else known_keys(key))  # fmt: skip
        allowed = f"{', '.join(keys)}, or " if keys else ""
        return ConfigError(
            f"{key} is not a key of the config; allowed: {allowed}+{key}=VALUE to add it"
        )
    if not isinstance(error, MissingConfigException) or "/" not in missing or not options:
        return ConfigError(cli.first_line(error))
    group, _, value = missing.rpartition("/")
    return ConfigError(f"{group}={value!r} is unknown; allowed: {', '.join(sorted(options))}")


def known_keys(key: str) -> list[str]:
    """The keys beside ``key`` (dotted) in gatherlab's config files: at the top, the config groups
    and the primary config's keys; below a group or a key, the keys that any of its options or
    its node has there (where Hydra's refusal does not carry the chosen option's node,
    `_one_line`)."""
    primary = OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml")
    parent = key.rpartition(".")[0]
    if not parent:
        groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name.isidentifier()}
        return sorted((groups | {str(k) for k in primary if k != "defaults"}) - {"__pycache__"})
    head, _, rest = parent.partition(".")
    nodes = [OmegaConf.load(path) for path in sorted((CONFIG_DIR / head).glob("*.yaml"))]
    nodes += [primary[head]] if head in primary else []
    keys: set[str] = set()
    for node in nodes:
        below = OmegaConf.select(node, rest) if rest else node
        if isinstance(below, DictConfig):
            keys |= {str(k) for k in below if k != "defaults"}
    return sorted(keys)


def override_values(overrides: Sequence[str]) -> dict[str, str]:
    """``key=value`` command-line overrides as a mapping (``+``/``++`` prefixes dropped), read by
    Hydra's own override parser."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {
        override.key_or_group: override.get_value_element_as_str()
        for override in parsed
        if not override.is_delete()
    }


def sweep_jobs(
    params: Mapping[str, str],
    overrides: Sequence[str],
    parser: OverridesParser | None = None,
) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands a sweep: the sweeper's ``params``
    first, then the command line's ``overrides`` (a later value of a key replaces an earlier one
    in its place), each sweep expanded into a Cartesian product, the first varying slowest. A
    sweep that is not a list of choices (``interval(...)``) is a ConfigError of one line.
    gatherlab's sweeper and ``job_overrides`` both expand through here."""
    parser = parser or OverridesParser.create()
    combined = parser.parse_overrides(
        [*(f"{key}={value}" for key, value in params.items()), *overrides]
    )
    by_key: dict[str, list[str]] = {}
    for override in combined:
        key = override.get_key_element()
        if not override.is_sweep_override():
            by_key[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            by_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise ConfigError(
                f"the sweep {override.input_line} cannot be expanded into jobs; allowed: "
                "choices, range(...), glob(...)"
            )
    return [list(job) for job in itertools.product(*by_key.values())]


def job_overrides(overrides: Sequence[str], multirun: bool) -> list[list[str]]:
    """The overrides of every job a command runs (``sweep_jobs`` with the composed config's
    ``hydra.sweeper.params``), without running Hydra's app: for scripts and tests that need a
    sweep's jobs."""
    if not multirun:
        return [list(overrides)]
    parser = OverridesParser.create()
    fixed = [
        o.input_line for o in parser.parse_overrides(list(overrides)) if not o.is_sweep_override()
    ]
    return sweep_jobs(compose_with_hydra(fixed).hydra.sweeper.params or {}, overrides, parser)


# --- building what a config names ----------------------------------------------------------------


def instantiate(group: str, node: DictConfig | Mapping[str, Any], **arguments: Any) -> Any:
    """``hydra.utils.instantiate(node, **arguments)``; a target that does not import or refuses
    its arguments is one line naming the group and the reason."""
    try:
        return hydra.utils.instantiate(node, **arguments)
    except InstantiationException as error:
        cause = error.__cause__ or error
        target = node.get("_target_", "?") if hasattr(node, "get") else "?"
        raise ConfigError(f"{group} ({target}): {cli.first_line(cause)}") from None


def build_dataset(cfg: DictConfig) -> Any:
    """The data set of ``cfg.data`` (its contract: docs/design.md §4)."""
    return instantiate("data", cfg.data.dataset)


def build_model(cfg: DictConfig) -> torch.nn.Module:
    """The model of ``cfg.model``, its initial weights drawn from ``cfg.seed`` (the same weights in
    every layout)."""
    torch.manual_seed(cfg.seed)
    return instantiate("model", cfg.model)


def build_gather(cfg: DictConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gather of ``cfg.gather``; None for ``gather=native`` (no ``_target_``): the loss
    communicates by itself."""
    if cfg.gather.get("_target_") is None:
        return None
    return instantiate("gather", cfg.gather)


def build_gather_option(
    name: str, overrides: Sequence[str] = ()
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gather that the option ``name`` of the ``gather`` group builds as ``overrides``
    compose it (``build_gather``; None for ``native``). The options are the group's YAML files
    (``group_options``), the one registry of gathers. Must run inside ``composed()``."""
    return build_gather(compose([*overrides, f"gather={name}"])[0])


def native_refusal(factory: Callable[..., Any], loss: str, option: str) -> str | None:
    """Why ``gather=native`` cannot run ``factory``, or None when it can.

    ``native`` passes no gather, for a loss that communicates by itself. A loss whose constructor
    takes ``gather=`` with a default (gatherlab's losses: ``"fixed"``) would gather with that
    default instead, and its run would be recorded as native: refused, naming the default. A
    loss without that parameter, or whose default is None, runs as given.

    Args:
        factory: the loss class or function.
        loss: how the message names the loss.
        option: how the message names the gather option (``gather=`` or ``--gather ``).

    Returns:
        The one-line message, or None.
    """
    try:
        parameter = inspect.signature(factory).parameters.get("gather")
    except (TypeError, ValueError):  # a builtin without a signature takes no gather=
        return None
    if parameter is None or parameter.default is None or parameter.default is parameter.empty:
        return None
    default = parameter.default
    named = default if isinstance(default, str) else getattr(default, "__qualname__", default)
    instead = f"{option}{default}" if isinstance(default, str) else f"{option}<a gather>"
    return (
        f"{option}native passes no gather, but {loss} takes gather= and would gather with its "
        f"default, {named!r}, not by itself; allowed: {instead} (or another option of the gather "
        "group), or native with a loss that communicates by itself"
    )


def loss_factory(cfg: DictConfig) -> Recipe:
    """The loss of ``cfg.loss`` with the gather of ``cfg.gather``, as a factory that each rank
    calls once its process group exists (``gatherlab.components.factory``). ``gather=native``
    with a loss that would gather with its own default (gatherlab's losses) is refused
    (``native_refusal``)."""
    gather = build_gather(cfg)
    factory = loss_factory_of(cfg.loss, gather, cfg.seed)
    if gather is None:
        refusal = native_refusal(factory.factory, f"loss ({cfg.loss._target_})", "gather=")
        if refusal is not None:
            raise ConfigError(refusal)
    return factory


def loss_factory_of(
    node: DictConfig, gather: Callable[[torch.Tensor], torch.Tensor] | None, seed: int
) -> Recipe:
    """A loss config node as a factory: ``_target_`` is any import path (``package.module:Class``
    or ``package.module.Class``), the other keys are the constructor's keyword arguments."""
    return _factory_of("loss", node, gather, seed, "mypkg.losses:MyLoss", "the loss module")


def _factory_of(
    key: str,
    node: DictConfig,
    gather: Callable[[torch.Tensor], torch.Tensor] | None,
    seed: int,
    example: str,
    returns: str,
    exclude: Sequence[str] = (),
) -> Recipe:
    """The factory of a node whose ``_target_`` is an import path and whose other keys (but
    ``exclude``) are its keyword arguments; built where it runs (``gatherlab.components.factory``).
    """
    if OmegaConf.is_missing(node, "_target_"):
        raise ConfigError(
            f"{key}._target_ is missing; allowed: an import path, e.g. "
            f"{key}._target_={example} (its arguments as +{key}.<name>=<value>)"
        )
    target = node.get("_target_")
    try:
        factory = locate(target)
    except ImportError as error:
        raise ConfigError(f"{key}._target_={target}: {error}") from None
    if not callable(factory):
        raise ConfigError(
            f"{key}._target_={target} is a {type(factory).__name__}; allowed: a class or "
            f"function that returns {returns}"
        )
    arguments = OmegaConf.to_container(node, resolve=True)
    for name in ("_target_", *exclude):
        arguments.pop(name, None)
    return Recipe(factory, arguments, gather, seed)


# --- a user's LightningModule and data set (module=user, data=user) ----------------------


USER = "user"
"""The option of the ``module``, ``data`` and ``loss`` groups that names the user's own code by its
import path (``module=user module._target_=mypkg.ssl:MyModule``); "external" names only ranks
that a launcher outside gatherlab started (``launcher=external``)."""


def is_user_module(cfg: DictConfig) -> bool:
    """Whether the run trains a user's LightningModule (``module=user``)."""
    return cfg.module.get("name") == USER


def is_user_data(cfg: DictConfig) -> bool:
    """Whether the data is a user's map-style data set (``data=user``)."""
    return cfg.data.get("name") == USER


def module_factory(cfg: DictConfig) -> Recipe:
    """The user's LightningModule of ``module=user`` as a factory that each rank calls once its
    process group exists (with ``rank=``/``world_size=`` when it takes them; its weights drawn
    from ``cfg.seed``)."""
    return _factory_of(
        "module", cfg.module, None, cfg.seed, "mypkg.ssl:MyModule", "a LightningModule", ("name",)
    )


def dataset_factory(cfg: DictConfig) -> Recipe:
    """The user's map-style data set of ``data=user`` as a factory, built where it runs."""
    return _factory_of(
        "data.dataset", cfg.data.dataset, None, cfg.seed, "mypkg.data:MyData", "a data set"
    )


def build_sharding(cfg: DictConfig) -> Sharding:
    """How ``cfg.strategy`` distributes gatherlab's module over the ranks (``ddp`` when the
    config has no strategy: a run written before the group existed)."""
    return Sharding(**OmegaConf.to_container(cfg.get("strategy") or {"name": "ddp"}))


def build_optimizer(cfg: DictConfig) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer factory of ``cfg.optim`` (parameters → optimizer)."""
    return instantiate("optim", cfg.optim)


def group_options(group: str, overrides: Sequence[str] = ()) -> list[str]:
    """The options of a config group: its YAML files in every directory of the search path that
    ``overrides`` compose (gatherlab's configs and each ``file://`` or ``pkg://`` entry of
    ``hydra.searchpath``), as Hydra's config loader lists them. Must run inside ``composed()``."""
    loader = GlobalHydra.instance().config_loader()
    try:
        options = loader.get_group_options(
            group,
            results_filter=ObjectType.CONFIG,
            config_name=CONFIG_NAME,
            overrides=list(overrides),
        )
    except HydraException as error:
        raise ConfigError(cli.first_line(error)) from None
    return sorted(options)


def build_gathers(names: Sequence[str] | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Name → gather for each option of the ``gather`` group in ``names`` (all when None, in the
    order of docs/design.md §1's table, ``gatherlab.gather.ordered``, without ``native``, which is
    no gather), each built from its YAML file as ``overrides`` compose it
    (``build_gather_option``). Must run inside ``composed()``."""
    every = names is None
    if every:
        names = group_options("gather", overrides)
    gathers = {name: build_gather_option(name, overrides) for name in names}
    if not every and None in gathers.values():
        native = [name for name, gather in gathers.items() if gather is None]
        raise ConfigError(
            f"audit.gathers names {', '.join(native)}, which is no gather (the loss communicates "
            "by itself); allowed: gathers with a _target_"
        )
    built = {name: gather for name, gather in gathers.items() if gather is not None}
    return ordered(built) if every else built
