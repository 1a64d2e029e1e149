"""The words of a check: its table's columns, each verdict's diagnosis (its meaning, usual cause
in code and fix) and each removal's of docs/design.md §10, and the text the command prints."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from gatherlab.check.removals import ALL, LOSS, NONE, STEP_RANDOMNESS, Removal
from gatherlab.core import runfiles, terms

EXACT = terms.GradientClass.EXACT
ALL_PARTS = "all"
"""The ``part`` of a row about the whole gradient (the rows of a check before parts existed)."""

COLUMNS = (
    "loss", "gather", "world_size", "part", "forward", "gradient", "verdict", "scale", "cause",
    "loss_diff", "cosine", "norm_ratio", "max_rel_err", "error",
)  # fmt: skip
"""The columns of a check's table (``check.csv``), in order; with ``steps`` a last column,
``train_max_abs_loss_diff``, follows. ``part`` is ``all`` for the whole gradient, then, when the
gradient has several parts, ``model`` and ``loss.<name>`` per trainable parameter of the loss;
``forward`` is ``same`` or ``differs``; ``gradient`` one of ``exact``, ``1/W``, ``W``,
``biased``, ``none``, ``other``; ``verdict`` is ``exact``, ``loss scaled``, ``loss differs``,
the gradient's class, ``diverges`` (with ``steps``) or ``failed``; ``scale`` the constant c of a
loss that is c × one device's; ``cause`` what reproduced a ``loss differs`` (``scaled``,
``local_negatives``, ``pair_order``, ``unexplained``) or split a ``biased`` gradient
(``parts``); ``error`` the failing rank's error line; ``loss_diff`` the relative difference of
the global loss; ``gather`` is ``native`` when the loss communicates by itself (docs/design.md
§5, §6)."""
TRAIN_COLUMN = "train_max_abs_loss_diff"


# --- what each verdict means --------------------------------------------------------------------

_GATHER_FIX = (
    "a gather whose backward sums every rank's gradient of each slice (gatherlab.gather.Fixed, "
    "torch.distributed.nn.functional.all_gather)"
)

# What was measured, what it means, and (labelled) the usual causes, which the check does not test.
DIAGNOSES = {
    terms.LOSS_DIFFERS: (
        "the loss itself is not the 1-device loss: the mean over ranks of what the ranks return "
        "differs from the loss of the whole batch (relative difference {loss_diff:.2g}); no "
        "backward can make it exact."
    ),
    terms.LOSS_SCALED: (
        "the global loss is {scale:.6g} times the 1-device loss on every batch compared (to a "
        "relative 1e-10) and the gradient is exact (max relative error {max_rel_err:.2g}): "
        "training is exact, only the logged value is scaled; divide it by the factor to compare "
        "it with one device. Usual cause (not tested here): a loss multiplied by W to undo "
        "DDP's average, on a gather whose backward keeps only the rank's own slot. Cleaner: "
        + _GATHER_FIX
        + " without the factor, which logs the 1-device value too."
    ),
    "1/W": (
        "the gradient is 1/W of one device's (norm ratio {norm_ratio:.6g}, cosine "
        "{cosine:.12g}): SGD's effective learning rate is "
        "divided by W, and anything added to the gradient outside the loss (L2 weight decay, "
        "another loss term) weighs W times more. Usual causes (not tested here): an all_gather "
        "without gradient with the live local tensor put back in its slot, or a gather whose "
        "backward keeps only the own slice, while every rank computes the full loss. Fix: "
        + _GATHER_FIX
        + "."
    ),
    "W": (
        "the gradient is W times one device's (norm ratio {norm_ratio:.6g}): SGD's effective "
        "learning rate is multiplied by W. Usual cause (not tested here): the loss multiplied by "
        "the world size to undo DDP's average, on top of a gather whose backward already sums "
        "the ranks' gradients. Fix: drop the factor."
    ),
    "biased": (
        "the gradient points in another direction than one device's (cosine {cosine:.6g}, norm "
        "ratio {norm_ratio:.4g}): no learning rate repairs that. Usual causes (not tested here): "
        "a loss over the rank's own rows (its anchors against the gathered batch) with a gather "
        "that drops the other ranks' gradients of this rank's slice (no gradient, or the own "
        "slice only), or a gather that averages the gathered path while the direct use of the "
        "local embeddings keeps its size. Fix: " + _GATHER_FIX + "."
    ),
    "none": (
        "no gradient reaches the model's parameters on W ranks, while one device has one: "
        "nothing connects the loss to the model, and DDP training fails at its first backward. "
        "Usual cause (not tested here): the embeddings used only through a gather without "
        "gradient (a torch.no_grad all_gather). Fix: " + _GATHER_FIX + "; putting the live local "
        "tensor back in its slot gives 1/W."
    ),
    "other": (
        "the gradient has the right direction (cosine {cosine:.12g}) but a scale that is neither "
        "1, 1/W nor W (norm ratio {norm_ratio:.6g}): some factor depends on the layout. Usual "
        "cause (not tested here): a loss divided by the local batch size in one place and by the "
        "global one in another."
    ),
    terms.DIVERGES: (
        "the first step agrees with one device, a later one does not: something besides the "
        "first step's loss and gradient depends on the layout (an optimizer state, a buffer "
        "updated per rank, randomness drawn after the first step)."
    ),
    terms.FAILED: (
        "a rank raised ({error}): the check has no verdict at this world size; the other world "
        "sizes have theirs."
    ),
}

# What reproduced a ``loss differs`` on one device (``gatherlab.check.hypotheses``), and its fix.
CAUSES = {
    terms.Cause.SCALED: (
        "Reproduced on one device: the global loss is {scale:.6g} times the 1-device loss on both "
        "batches checked (to a relative 1e-10), while the gradient is {gradient} (norm ratio "
        "{norm_ratio:.6g}, cosine {cosine:.12g}): a factor that depends on W scales the loss and "
        "its gradient is not one device's either, e.g. a loss multiplied by W on a gather whose "
        "backward already sums the ranks' gradients. Fix: drop the factor."
    ),
    terms.Cause.LOCAL_NEGATIVES: (
        "Reproduced on one device to a relative 1e-10 on both batches checked: the global loss "
        "is the mean over ranks of the 1-device loss of each rank's slice alone. Each rank's "
        "loss sees only its own rows: its negatives, targets or batch statistics are local. Fix: "
        "gather every rank's embeddings through " + _GATHER_FIX + ", and compute the loss, or "
        "its statistics, over the gathered batch."
    ),
    terms.Cause.PAIR_ORDER: (
        "Reproduced on one device to a relative 1e-10 on both batches checked: the global loss "
        "is the 1-device loss of the rows in the order that concatenating the two views per rank "
        "and then gathering produces ([view 0 of rank 0; view 1 of rank 0; view 0 of rank 1; "
        "…]). The loss pairs rows by position as if the gathered tensor were view-major, so its "
        "positives are other samples' rows. Fix: gather each view separately, or reorder the "
        "gathered rows to [every rank's view 0; every rank's view 1] before pairing."
    ),
    terms.Cause.UNEXPLAINED: (
        "None of the causes the check reproduces on one device (scaled, local_negatives, "
        "pair_order) gives the global loss. Usual causes (not tested here): statistics of the "
        "rank's own batch (mean, standard deviation, covariance, batch norm), a normalisation by "
        "the local batch size, targets offset by the rank, randomness drawn per rank. Fix: "
        "compute every statistic over the gathered batch, through " + _GATHER_FIX + "."
    ),
}

# What a part's class says when the parts of a biased gradient differ (cause ``parts``).
PART_MEANINGS = {
    "exact": (
        "a part that is exact gets the 1-device gradient on every rank, e.g. a parameter of the "
        "loss used after the gather, alike on every rank (DDP's average of identical gradients "
        "is that gradient)"
    ),
    "1/W": (
        "a part at 1/W gets its gradient only through the rank's own slice of the gathered "
        "embeddings (usually, not tested here: a gather whose backward keeps only its own slice, "
        "or a no-grad gather with the live local tensor in its slot, while every rank computes "
        "the full loss)"
    ),
    "W": "a part at W gets W times one device's gradient (usually: a factor of W in the loss)",
    "none": "a part with no gradient is reached only through a gather without gradient",
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
    STEP_RANDOMNESS: (
        "the training step draws from the global random streams (measured: its first loss on "
        "one device changes when only the streams' seed changes, dropout layers off), e.g. "
        "augmentations applied to the batch in the step: W ranks draw other numbers for a sample "
        "than one device, and no removal takes that out (with it, the check cannot see whether "
        "the loss is exact too). Fix: draw each sample's randomness from a generator seeded by "
        "(seed, step, sample index), e.g. torch.Generator().manual_seed(...) per sample, or "
        "augment in the data set and check with the data_randomness removal."
    ),
    LOSS: (
        "with batch norm, dropout and the data's randomness removed the run is still not exact: "
        "the loss itself, or how it communicates across ranks (its gather), breaks it."
    ),
}


def verdict(forward: str, gradient: str, scale: float | None = None) -> str:
    """``exact`` when forward and gradient are; ``loss scaled`` when the forward is a constant
    multiple ``scale`` of one device's and the gradient is exact; ``loss differs`` when the
    forward differs otherwise; else the gradient's class."""
    if forward == terms.Forward.DIFFERS:
        return terms.LOSS_SCALED if scale is not None and gradient == EXACT else terms.LOSS_DIFFERS
    return gradient


class _PerWorldSize:
    """The numbers of several world sizes, formatted one after the other ("0.5, 0.25")."""

    def __init__(self, values: Iterable[Any]):
        self.values = list(values)

    def __format__(self, spec: str) -> str:
        return ", ".join(format(value, spec) for value in self.values)

    def __str__(self) -> str:
        return ", ".join(str(value) for value in self.values)


def scale_text(scale: Any) -> str:
    """A loss's constant factor as the table prints it (×2); a dash for none."""
    return "—" if pd.isna(scale) else f"×{scale:.6g}"


def _paragraph(text: str) -> str:
    """A diagnosis as the printed paragraph: capitalised, wrapped at 100 columns, indented."""
    return textwrap.fill(
        text[0].upper() + text[1:], 100, initial_indent="  ", subsequent_indent="  "
    )


def _numbers(rows: pd.DataFrame) -> dict[str, Any]:
    """A group's numbers for the diagnoses' placeholders, one per world size."""
    numbers: dict[str, Any] = {
        c: _PerWorldSize(rows[c]) for c in ("loss_diff", "cosine", "norm_ratio", "max_rel_err")
    }
    numbers["scale"] = _PerWorldSize(rows["scale"])
    numbers["gradient"] = _PerWorldSize(rows["gradient"].unique())
    numbers["error"] = "; ".join(
        f"W = {w}: {e}" for w, e in zip(rows["world_size"], rows["error"], strict=True)
    )
    return numbers


def _parts_text(parts: pd.DataFrame) -> str:
    """What the parts of a biased gradient measured, and what each class among them says."""
    measured = []
    for part, rows in parts.groupby("part", sort=False):
        classes = "/".join(rows["gradient"].unique())
        numbers = _PerWorldSize(rows["norm_ratio"])
        cosines = _PerWorldSize(rows["cosine"])
        measured.append(f"{part} {classes} (norm ratio {numbers:.10g}; cosine {cosines:.12g})")
    meanings = [PART_MEANINGS[c] for c in parts["gradient"].unique() if c in PART_MEANINGS]
    return (
        "Measured per part: " + "; ".join(measured) + ". The parts carry different factors of "
        "one device's gradient, so their sum points elsewhere. "
        + "; ".join(meanings).capitalize()[:1]
        + "; ".join(meanings)[1:]
        + ". Fix: "
        + _GATHER_FIX
        + ": then every part is exact."
    )


def diagnosis(rows: pd.DataFrame, parts: pd.DataFrame | None = None) -> str:
    """What the rows (one loss and gather, one verdict and cause, their world sizes) measured,
    what reproduced it or what its parts show, and what would make it exact."""
    first = rows.iloc[0]
    numbers = _numbers(rows)
    text = DIAGNOSES[first["verdict"]].format(**numbers)
    cause = first["cause"]
    if first["verdict"] == terms.LOSS_DIFFERS and cause:
        text += " " + CAUSES[terms.Cause(cause)].format(**numbers)
    elif cause == terms.Cause.PARTS and parts is not None and len(parts):
        text = (
            f"the gradient points in another direction than one device's (cosine "
            f"{numbers['cosine']:.6g}, norm ratio {numbers['norm_ratio']:.4g}). "
            + _parts_text(parts)
        )
    return text


def _shown_parts(table: pd.DataFrame) -> pd.DataFrame:
    """The rows to print: every ``all`` row, and the part rows of each loss, W (and run) where a
    part's class differs from the whole's."""
    keys = [k for k in ("loss", "gather", "world_size", "removed") if k in table.columns]
    records = table.to_dict("records")

    def key(record: dict[str, Any]) -> tuple:
        return tuple(record[k] for k in keys)

    whole = {key(r): r["gradient"] for r in records if r["part"] == ALL_PARTS}
    differing = {
        key(r) for r in records if r["part"] != ALL_PARTS and r["gradient"] != whole.get(key(r))
    }
    return table[[r["part"] == ALL_PARTS or key(r) in differing for r in records]]


def explain(table: pd.DataFrame) -> str:
    """The check as text: the table, then for every verdict other than exact (per loss) its
    diagnosis, once for all the world sizes that share it.

    This is what ``python -m gatherlab.check`` prints and the message of
    `gatherlab.testing.assert_layout_invariant`'s ``AssertionError``.

    Args:
        table: a table of `check_loss` or `check_gather` (the columns of `COLUMNS`, and
            ``train_max_abs_loss_diff`` when present).

    Returns:
        The table as Markdown (the parts of a loss and W only where one differs in class from
        the whole gradient), then one paragraph per loss, gather, verdict and cause other than
        ``exact``: the world sizes, the verdict, what was measured or reproduced, the usual
        causes in code (labelled as not tested) and the fix. When every verdict is exact (or
        ``loss scaled``), the last paragraph says so. The text ends with a newline.

    Example:
        >>> from gatherlab.check import check_loss, explain
        >>> text = explain(check_loss("gatherlab.losses:NTXentLoss", gather="fixed"))
        >>> text.splitlines()[-1]
        'Every world size trains like one device (float64, to 1e-10).'
        >>> print(explain(check_loss("gatherlab.losses:NTXentLoss", gather="old")))  # diagnoses
    """
    lines = [markdown(_shown_parts(table))]
    whole = table[table["part"] == ALL_PARTS]
    failing = whole[whole["verdict"] != EXACT]
    for (loss, gather, verdict_, cause), rows in failing.groupby(
        ["loss", "gather", "verdict", "cause"], sort=False
    ):
        sizes = ", ".join(str(size) for size in rows["world_size"])
        via = "" if gather == "native" else f" with gather {gather}"
        parts = table[
            (table["loss"] == loss) & (table["gather"] == gather)
            & table["world_size"].isin(rows["world_size"]) & (table["part"] != ALL_PARTS)
        ]  # fmt: skip
        named = f" ({cause})" if cause and verdict_ != terms.LOSS_SCALED else ""
        lines.append(f"{loss}{via}, W = {sizes}: {verdict_}{named}\n"
                     f"{_paragraph(diagnosis(rows, parts))}")  # fmt: skip
    if trains_like_one_device(table):
        lines.append("Every world size trains like one device (float64, to 1e-10).")
    return "\n\n".join(lines) + "\n"


# The columns the check of a training step prints (check.csv has them all).
TRAINING_COLUMNS = (
    "world_size", "removed", "part", "forward", "gradient", "verdict", "scale", "first_diff_step",
    "train_max_abs_loss_diff", "max_abs_param_diff", "cosine", "norm_ratio", "error",
)  # fmt: skip


# Columns printed only when a row has something in them.
OPTIONAL = ("part", "scale", "cause", "error")


def markdown(table: pd.DataFrame, columns: Sequence[str] = (*COLUMNS, TRAIN_COLUMN)) -> str:
    columns = [c for c in columns if c in table.columns]
    if "part" in table.columns and (table["part"] == ALL_PARTS).all():
        columns.remove("part")
    for column in ("scale", "cause", "error"):
        if column in columns and not table[column].map(_filled).any():
            columns.remove(column)

    def cell(column: str, value: Any) -> str:
        if column == "scale":
            return scale_text(value)
        if value is pd.NA or (isinstance(value, float) and pd.isna(value)):
            return "—"  # a step column with no such step, a failed W's numbers, no cosine
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [[cell(c, row[c]) for c in columns] for _, row in table.iterrows()]
    return runfiles.markdown_table(columns, rows)


def _filled(value: Any) -> bool:
    return not (value is None or value == "" or (isinstance(value, float) and pd.isna(value)))


TRAINS_LIKE_ONE_DEVICE = (EXACT, terms.LOSS_SCALED)
"""The verdicts of a world size that trains like one device: ``loss scaled`` only logs a scaled
value."""


def trains_like_one_device(table: pd.DataFrame) -> bool:
    """Whether a check's table says every world size trains like one device: every verdict of
    the whole gradient ``exact`` or ``loss scaled`` (`check_loss`, `check_gather`), or for
    `check_training` every run without removals."""
    if "removed" in table:
        table = table[table["removed"] == NONE]
    if "part" in table:
        table = table[table["part"] == ALL_PARTS]
    return bool(table["verdict"].isin(TRAINS_LIKE_ONE_DEVICE).all())


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
    runs = table[table["part"] == ALL_PARTS]
    for world_size, rows in runs.groupby("world_size", sort=False):
        by_run = rows.set_index("removed")["verdict"]
        culprits = rows["culprits"].iloc[0]
        made = [r for r in (ALL, *Removal) if r in by_run.index]
        after = by_run[made[0]] if made else "—"
        summary.append([str(world_size), by_run[NONE], culprits or "—", after])
    header = ["world_size", "verdict", "culprits", "verdict with every removal made"]
    lines = [runfiles.markdown_table(header, summary),
             markdown(_shown_parts(table), TRAINING_COLUMNS)]  # fmt: skip
    kept = runs[runs["removed"] == NONE]
    # the verdicts that say more than their culprits: measured, reproduced or split in parts
    said = kept[
        kept["verdict"].isin((terms.DIVERGES, terms.LOSS_SCALED, terms.FAILED))
        | (kept["cause"] == terms.Cause.PARTS)
    ]
    for (verdict_, cause), rows in said.groupby(["verdict", "cause"], sort=False):
        sizes = ", ".join(str(w) for w in rows["world_size"])
        parts = table[table["world_size"].isin(rows["world_size"]) & (table["part"] != ALL_PARTS)]
        named = f" ({cause})" if cause == terms.Cause.PARTS else ""
        lines.append(f"W = {sizes}: {verdict_}{named}\n{_paragraph(diagnosis(rows, parts))}")
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
