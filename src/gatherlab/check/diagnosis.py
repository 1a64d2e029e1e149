"""The words of a check: its table's columns, each verdict's diagnosis (its meaning, usual cause
in code and fix) and each removal's of docs/design.md §10, and the text the command prints."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from gatherlab.check.removals import ALL, LOSS, NONE, Removal
from gatherlab.core import runfiles, terms

EXACT = terms.GradientClass.EXACT

COLUMNS = (
    "loss", "gather", "world_size", "forward", "gradient", "verdict", "loss_diff", "cosine",
    "norm_ratio", "max_rel_err",
)  # fmt: skip
"""The columns of a check's table (``check.csv``), in order; with ``steps`` a last column,
``train_max_abs_loss_diff``, follows. ``forward`` is ``same`` or ``differs``; ``gradient`` one of
``exact``, ``1/W``, ``W``, ``biased``, ``none``, ``other``; ``verdict`` is ``exact``, ``loss
differs`` or the gradient's class; ``loss_diff`` is the relative difference of the global loss;
``gather`` is ``native`` when the loss communicates by itself (docs/design.md §5, §6)."""
TRAIN_COLUMN = "train_max_abs_loss_diff"


# --- what each verdict means --------------------------------------------------------------------

DIAGNOSES = {
    terms.LOSS_DIFFERS: (
        "the loss itself is not the 1-device loss: the mean over ranks of what the ranks return "
        "differs from the loss of the whole batch (relative difference {loss_diff:.2g}). Usual "
        "causes: statistics of the rank's own batch (mean, standard deviation, covariance, batch "
        "norm), negatives or targets taken from the local batch only, or a normalisation by the "
        "local batch size. No backward can make it exact. Fix: compute every statistic over the "
        "gathered batch, through a gather whose backward sums the ranks' gradients "
        "(gatherlab.gather.Fixed, torch.distributed.nn.functional.all_gather)."
    ),
    "1/W": (
        "every rank computes the full loss but gradients reach only the local slice: the "
        "gradient is 1/W of one device's (norm ratio {norm_ratio:.6g}, cosine {cosine:.12g}); "
        "SGD's effective learning rate is divided by W, and anything added to the gradient "
        "outside the loss (L2 weight decay, another loss term) weighs W times more. Usual cause: "
        "an all_gather without gradient with the live local tensor put back in its slot "
        "(OpenCLIP's gather_with_grad=False), or a gather whose backward keeps only the own "
        "slice (lightly's GatherLayer before PR #1531). Fix: a gather whose backward sums every "
        "rank's gradient of each slice (gatherlab.gather.Fixed, "
        "torch.distributed.nn.functional.all_gather)."
    ),
    "W": (
        "the gradient is W times one device's (norm ratio {norm_ratio:.6g}): SGD's effective "
        "learning rate is multiplied by W. Usual cause: the loss multiplied by the world size to "
        "undo DDP's average, on top of a gather whose backward already sums the ranks' "
        "gradients. Fix: drop the factor."
    ),
    "biased": (
        "the gradient points in another direction than one device's (cosine {cosine:.6g}, norm "
        "ratio {norm_ratio:.4g}): part of the paths from the loss to the embeddings is missing or "
        "scaled differently from the rest, and no learning rate repairs that. Usual causes: a "
        "loss over the rank's own rows (its anchors against the gathered batch) with a gather "
        "that drops the other ranks' gradients of this rank's slice (no gradient, or the own "
        "slice only), or a gather that averages the gathered path while the direct use of the "
        "local embeddings keeps its size. Fix: a gather whose backward sums every rank's "
        "gradient of each slice (gatherlab.gather.Fixed, "
        "torch.distributed.nn.functional.all_gather)."
    ),
    "none": (
        "no gradient reaches the model's parameters on W ranks, while one device has one: the "
        "loss uses the embeddings only through a gather without gradient (a torch.no_grad "
        "all_gather such as MoCo's concat_all_gather), so nothing connects the loss to the "
        "model, and DDP training fails at its first backward. Fix: a gather whose backward sums "
        "every rank's gradient of each slice (exact); putting the live local tensor back in its "
        "slot gives 1/W."
    ),
    "other": (
        "the gradient has the right direction (cosine {cosine:.12g}) but a scale that is neither "
        "1, 1/W nor W (norm ratio {norm_ratio:.6g}): some factor depends on the layout, e.g. a "
        "loss divided by the local batch size in one place and by the global one in another."
    ),
    terms.DIVERGES: (
        "the first step agrees with one device, a later one does not: something besides the "
        "first step's loss and gradient depends on the layout (an optimizer state, a buffer "
        "updated per rank, randomness drawn after the first step)."
    ),
}


# What each culprit of docs/design.md §10 means, and its fix (the check of a training step): the
# cause each removal takes out, and the loss, which remains when all of them are made.
CULPRIT_DIAGNOSES = {
    Removal.BATCHNORM: (
        "batch norm normalises each rank's batch with its own statistics (plain DDP's "
        "BatchNorm), so W ranks compute another function of the batch than one device. Fix: "
        "statistics over the global batch: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
        "on GPUs (NCCL), gatherlab.components.batchnorm.GlobalBatchNorm on any backend; or no "
        "batch norm where the split batch passes."
    ),
    Removal.DROPOUT: (
        "dropout masks come from each process's random generator, so a sample's mask depends on "
        "the rank that holds it and on what that rank drew before. Fix: draw each sample's mask "
        "from a generator seeded by (seed, epoch, sample index) "
        "(gatherlab.components.models.SeededDropout), or accept the difference: noise of the "
        "same distribution, not a bias."
    ),
    Removal.DATA_RANDOMNESS: (
        "the data set's augmentations draw from each process's global random streams (random, "
        "numpy, torch), so a sample's views depend on the rank that loads it. Fix: seed each "
        "sample's augmentation from its index and the epoch, e.g. a torch.Generator seeded by "
        "(seed, epoch, index) in __getitem__."
    ),
    LOSS: (
        "with batch norm, dropout and the data's randomness removed the run is still not exact: "
        "the loss itself, or how it communicates across ranks (its gather), breaks it."
    ),
}


def verdict(forward: str, gradient: str) -> str:
    """``exact`` when forward and gradient are; ``loss differs`` when the forward differs; else
    the gradient's class."""
    if forward == terms.Forward.DIFFERS:
        return terms.LOSS_DIFFERS
    return gradient


def diagnosis(row: Mapping[str, Any]) -> str:
    """What a row's verdict means, its usual cause in code and what would make it exact."""
    return DIAGNOSES[row["verdict"]].format(**row) if row["verdict"] != EXACT else EXACT


class _PerWorldSize:
    """The numbers of several world sizes, formatted one after the other ("0.5, 0.25")."""

    def __init__(self, values: Iterable[float]):
        self.values = list(values)

    def __format__(self, spec: str) -> str:
        return ", ".join(format(value, spec) for value in self.values)


def _paragraph(text: str) -> str:
    """A diagnosis as the printed paragraph: capitalised, wrapped at 100 columns, indented."""
    return textwrap.fill(
        text[0].upper() + text[1:], 100, initial_indent="  ", subsequent_indent="  "
    )


def explain(table: pd.DataFrame) -> str:
    """The check as text: the table, then for every verdict other than exact (per loss) its
    diagnosis, once for all the world sizes that share it.

    This is what ``python -m gatherlab.check`` prints and the message of
    `gatherlab.testing.assert_layout_invariant`'s ``AssertionError``.

    Args:
        table: a table of `check_loss` or `check_gather` (the columns of `COLUMNS`, and
            ``train_max_abs_loss_diff`` when present).

    Returns:
        The table as Markdown, then one paragraph per loss, gather and verdict other than
        ``exact``: the world sizes, the verdict, and what it means, its usual cause in code and
        the fix. When every verdict is exact, the last paragraph says so. The text ends with a
        newline.

    Example:
        >>> from gatherlab.check import check_loss, explain
        >>> text = explain(check_loss("gatherlab.losses:NTXentLoss", gather="fixed"))
        >>> text.splitlines()[-1]
        'Every world size trains like one device (float64, to 1e-10).'
        >>> print(explain(check_loss("gatherlab.losses:NTXentLoss", gather="old")))  # diagnoses
    """
    lines = [markdown(table)]
    failing = table[table["verdict"] != EXACT]
    for (loss, gather, verdict_), rows in failing.groupby(
        ["loss", "gather", "verdict"], sort=False
    ):
        sizes = ", ".join(str(size) for size in rows["world_size"])
        via = "" if gather == "native" else f" with gather {gather}"
        numbers = {"verdict": verdict_}
        numbers.update({c: _PerWorldSize(rows[c]) for c in ("loss_diff", "cosine", "norm_ratio")})
        lines.append(f"{loss}{via}, W = {sizes}: {verdict_}\n{_paragraph(diagnosis(numbers))}")
    if failing.empty:
        lines.append("Every world size trains like one device (float64, to 1e-10).")
    return "\n\n".join(lines) + "\n"


# The columns the check of a training step prints (check.csv has them all).
TRAINING_COLUMNS = (
    "world_size", "removed", "forward", "gradient", "verdict", "first_diff_step",
    "train_max_abs_loss_diff", "max_abs_param_diff", "cosine", "norm_ratio",
)  # fmt: skip


def markdown(table: pd.DataFrame, columns: Sequence[str] = (*COLUMNS, TRAIN_COLUMN)) -> str:
    columns = [c for c in columns if c in table.columns]

    def cell(value: Any) -> str:
        if value is pd.NA:  # a step column with no such step
            return "—"
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [[cell(row[c]) for c in columns] for _, row in table.iterrows()]
    return runfiles.markdown_table(columns, rows)


def trains_like_one_device(table: pd.DataFrame) -> bool:
    """Whether a check's table says every world size trains like one device: every verdict
    ``exact`` (`check_loss`, `check_gather`), or for `check_training` every run without
    removals."""
    if "removed" in table:
        table = table[table["removed"] == NONE]
    return bool((table["verdict"] == EXACT).all())


def explain_training(table: pd.DataFrame) -> str:
    """The check of a training step as text: one row per W (its verdict, the culprits found, the
    verdict with all removals made), the table of its runs, then what each culprit means and its
    fix.

    Args:
        table: a table of `check_training`.

    Returns:
        The text ``python -m gatherlab.check --module`` prints, ending with a newline.
    """
    summary = []
    for world_size, rows in table.groupby("world_size", sort=False):
        by_run = rows.set_index("removed")["verdict"]
        culprits = rows["culprits"].iloc[0]
        made = [r for r in (ALL, *Removal) if r in by_run.index]
        after = by_run[made[0]] if made else "—"
        summary.append([str(world_size), by_run[NONE], culprits or "—", after])
    header = ["world_size", "verdict", "culprits", "verdict with every removal made"]
    lines = [runfiles.markdown_table(header, summary), markdown(table, TRAINING_COLUMNS)]
    kept = table[table["removed"] == NONE]
    diverging = kept.loc[kept["verdict"] == terms.DIVERGES, "world_size"]
    if len(diverging):
        sizes = ", ".join(str(w) for w in diverging)
        lines.append(f"W = {sizes}: {terms.DIVERGES}\n{_paragraph(DIAGNOSES[terms.DIVERGES])}")
    found = [c for c in table["culprits"].str.split(";").explode().unique() if c]
    for culprit in found:
        sizes = ", ".join(
            str(w)
            for w in table.loc[table["culprits"].str.contains(culprit), "world_size"].unique()
        )
        lines.append(f"{culprit}, W = {sizes}:\n{_paragraph(CULPRIT_DIAGNOSES[culprit])}")
    loss_check = table.attrs.get("loss_check")
    if loss_check is not None:
        lines.append("The loss on its own (gatherlab.check on the loss attribute):\n"
                     + explain(loss_check).rstrip())  # fmt: skip
    elif LOSS in found:
        lines.append("  Name the module's loss attribute (--loss-attr) to check the loss alone.")
    if trains_like_one_device(table):
        lines.append("Every world size trains like one device.")
    return "\n\n".join(lines) + "\n"
