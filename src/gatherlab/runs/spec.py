"""One run, as every training form trains it on a rank (docs/design.md §2, docs/checking.md §10):
`RunSpec`, the facts every form needs, documented once, and `Form`, what a training form is.

A form says *what* is trained (a LightningModule, `runs.fit.Module`; a plain step,
`runs.plainstep.Step`; a whole update, `runs.update.Update`; a loss on gatherlab's MLP,
`runs.loss.Loss`); the spec says *how* (the data, the removals, the batch, the steps, the seed,
…). Both are picklable and travel whole to the ranks: ``ranks_for(W).run(form.train_on_rank,
spec)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from gatherlab.components.factory import Recipe
from gatherlab.runs.removals import Removals

if TYPE_CHECKING:
    from torch import nn

    from gatherlab.core.runfiles import Trained
    from gatherlab.runs.trace import Op

__all__ = ["Form", "RunSpec", "StepForm", "TracedForm"]


@dataclass(frozen=True)
class RunSpec:
    """How a run is trained, whatever form trains it."""

    data: Recipe | None
    """The map-style data set (``len``, ``data[index]``), built inside each rank; None for the
    loss form, which holds its global batches itself (`runs.loss.Loss`)."""
    global_batch_size: int
    """Samples per optimizer step over all ranks; rank r takes the r-th contiguous slice of each
    global batch (docs/design.md §2)."""
    steps: int
    """Optimizer steps (updates) of the run."""
    seed: int
    """The seed of the initial weights, the data order and every process's global random
    streams: the same on every rank and on one device."""
    precision: str
    """Lightning's precision name (``"64-true"``, ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``
    or ``"bf16-true"``, `core.terms.Precision`)."""
    removals: Removals = field(default_factory=Removals)
    """The removals made on the module and the data set (docs/checking.md §10)."""
    shuffle: bool = True
    """Whether the global batches are drawn in a seeded random order (else in index order)."""
    micro_batches: int = 1
    """K, the micro-batches of each rank's update (the whole-update form only; 1 for others)."""
    reduced: tuple[str, ...] = ()
    """Parameters whose gradients the run all-reduces (the mean over ranks) after each backward:
    the reproduction of an unreduced part (docs/checking.md §10, "Sharded code")."""
    strategy: str = "ddp"
    """The Lightning strategy a LightningModule trains under on W ranks (`core.terms.Strategy`:
    ``ddp``, or ``fsdp2``: ``ModelParallelStrategy``, the module sharding itself in
    ``configure_model``); the plain forms distribute as their factories do."""
    find_unused: bool = False
    """The check's DDP built with ``find_unused_parameters=True``: the reproduction of a reducer
    that waited for a parameter its forward does not use (docs/checking.md §10, "Sharded code")."""
    tensor_parallel: int = 1
    """T, the tensor-parallel degree of a plain form's layout: its W ranks a (W / T) × T mesh
    (`gatherlab.ranks.world.mesh`) given to the model factory as ``mesh``, the T ranks of a
    tensor-parallel group holding the same rows of each global batch (docs/checking.md §10, "Tensor
    and sequence parallelism"); 1: none (each rank its own rows)."""
    expert_parallel: int = 1
    """E, the expert-parallel degree of a plain form's layout: its W ranks a (W / E) × E mesh
    named ("dp", "ep") (`gatherlab.ranks.world.mesh`) given to the model factory as ``mesh``,
    which keeps the rank's experts under one device's names; each rank its own rows of each
    global batch; no DDP around it: the code reduces its gradients itself (docs/checking.md §10,
    "Expert parallelism"); 1: none."""
    pipeline_parallel: int = 1
    """P, the pipeline-parallel degree of a whole update's layout: its W ranks a (W / P) × P mesh
    named ``("dp", "pp")`` given to the model factory as ``mesh``, each rank keeping its stages
    of the model, the P ranks of a pipeline holding the same rows of each global batch
    (docs/checking.md §10, "Pipeline parallelism"); 1: none."""
    row_blocks: int = 1
    """The model's forward in this many row blocks on one device (`runs.precision.RowBlocks`):
    the perturbation a low precision's floor is measured with (docs/design.md §2)."""
    keep_precision: bool = False
    """The first gradient and the final parameters kept in the parameters' own dtype (float32 for
    float32 and the mixed precisions), not float64 (`runs.steplog.StepLog`): a check judged in
    floors of its precision alone (docs/design.md §2, "Low precision at size")."""
    step_budget_s: float = math.inf
    """The seconds a step may take before its run says so (`runs.steplog.StepLog`): a step of
    one device, or of rank 0, that takes longer logs a warning with the steps done and to go."""

    @property
    def replica_ranks(self) -> int:
        """The ranks that hold one replica of the model between them and take the same rows of
        each global batch: T of a tensor-parallel layout, P of a pipeline, else 1."""
        return self.tensor_parallel * self.pipeline_parallel


@runtime_checkable
class Form(Protocol):
    """A training form: what is trained, trained on this rank by `train_on_rank` (on one device
    without a process group, else on this rank of its group)."""

    def train_on_rank(self, spec: RunSpec) -> Trained:
        """Train the run ``spec`` describes here; returns each step's global loss, the first
        step's gradient as the optimizer takes it, and the final parameters."""
        ...


@runtime_checkable
class TracedForm(Form, Protocol):
    """A form whose first step can be recorded (`runs.trace`), for where it departs."""

    def trace_on_rank(self, spec: RunSpec) -> list[Op]:
        """The operations of the first step on this rank, with their gradients."""
        ...


class StepForm(Form, Protocol):
    """A form of the check of a training step (docs/checking.md §10: a LightningModule, a plain
    step, a whole update): what the check asks of it on one device, before any rank starts."""

    option: ClassVar[str]
    """The command line's option that names it (``--module``, ``--step``, ``--update``)."""

    @property
    def recipe(self) -> Recipe:
        """The factory of what it trains: the module, or the model."""
        ...

    def built_label(self, label: str) -> str:
        """How an error in building `recipe` names it (``label`` names the form)."""
        ...

    def checked(self, built: Any, label: str) -> nn.Module:
        """What `recipe` built, when it keeps the form's contract; a ValueError of one line,
        starting with ``label``, otherwise."""
        ...

    def collate(self, data: Any) -> Callable[[list[Any]], Any] | None:
        """What collates its batches of ``data`` (None: PyTorch's default)."""
        ...

    def one_step(self, built: nn.Module, batch: Any) -> Any:
        """What one step of it returns on ``batch`` from ``built``'s weights, outside training
        (the loss, or a mapping holding it as ``"loss"``)."""
        ...
