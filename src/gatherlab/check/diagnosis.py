"""The words of a check: each verdict's diagnosis (its meaning, usual cause in code and fix), each
culprit's of docs/checking.md §10 (a removal's is its own, `gatherlab.runs.removals.Removal`), and
the text the command prints; the table they describe is `gatherlab.check.table`'s."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from gatherlab.check.table import (
    ALL_PARTS,
    COLUMNS,
    EXACT,
    REFERENCE,
    TRAIN_COLUMN,
    TRAINS_LIKE_ONE_DEVICE,
    CheckResult,
    result_of,
    trains_like_one_device,
)  # fmt: skip
from gatherlab.core import gradients, runfiles, terms
from gatherlab.core.floor import (
    FLOOR_THRESHOLD,
    WITHIN,
    Floored,
    power_words,
)
from gatherlab.core.terms import Culprit
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS
from gatherlab.runs.removals import ALL, NONE, Removal

# --- what each verdict means --------------------------------------------------------------------

# the float64 bound of docs/design.md §2, as the texts write it
_FLOAT64 = f"{gradients.FLOAT64_TOLERANCE:g}"
_GATHER_FIX = (
    "a gather whose backward sums every rank's gradient of each slice (gatherlab.gather.Fixed, "
    "Lightning's self.all_gather(x, sync_grads=True), or an autograd Function whose backward "
    "sums the gradient over the ranks (torch.distributed.all_reduce) and returns the rank's own "
    "slice)"
)

# What a constant factor of the whole gradient does to training, per optimizer (docs/design.md §1).
UNIFORM_FACTOR = (
    "A factor c of the whole gradient is, under SGD with or without momentum, the learning rate "
    "multiplied by c (momentum sums c times the gradients); under Adam and AdamW it almost "
    "cancels, since they divide by a running estimate of the gradient's magnitude: only ε, and "
    "any term added to the gradient outside this loss (Adam's weight_decay, an L2 penalty, "
    "another loss term), weigh 1/c times as much as on one device (AdamW's decoupled weight "
    "decay is untouched)."
)
# What factors that differ between parts do to training.
PART_FACTORS = (
    "Different factors per part are no learning rate: under SGD, with or without momentum, no "
    "single learning rate repairs them (each part trains at its own factor times the rate); "
    "under Adam and AdamW, which divide each parameter's step by its own gradient's magnitude, "
    "each part's factor mostly cancels (up to ε and any term added to the gradient), so the run "
    "is close to one device's without being it."
)
_ACCUMULATION_FIX = (
    "divide the loss by K exactly once per update (each micro-batch's loss of a mean when "
    "accumulating naively; nothing when a cached recomputation backpropagates the whole batch's "
    "loss), and backpropagate a parameter of the loss, such as a learnt temperature, once per "
    "update, not once per micro-batch"
)

# The diagnosis of ``none`` where one device has no gradient either (its norm ratio is NaN).
TRAINS_NOTHING = (
    "no gradient reaches the model's parameters, on W ranks or on one device: the loss trains "
    "nothing (its value does not depend on the parameters through anything with a gradient: "
    "inputs detached, a value computed under torch.no_grad, a constant), so a training run's "
    "backward raises or leaves the parameters as they are. Fix: compute the loss from the "
    "embeddings themselves, not from detached copies."
)

# The usual causes (not tested) and the fix of each factor that involves K, the micro-batches each
# rank accumulates (`terms.Factor`); `_factor_text` adds what was measured and what it does.
FACTOR_CAUSES = {
    terms.Factor.ONE_OVER_K: (
        "the loss divided by K twice (by the loop and by a trainer that already divides, such as "
        "Lightning's accumulate_grad_batches), or a cached recomputation that backpropagates the "
        "whole batch's loss divided by K. Fix: " + _ACCUMULATION_FIX + ". In a pipeline (K its "
        "schedule's micro-batches): the schedule's scale_grads=True (its default: each gradient "
        "÷ K) on a loss_fn that already divides by the micro-batches, such as a sum ÷ the global "
        "count of tokens; fix there: scale_grads=False."
    ),
    terms.Factor.K: (
        "K micro-batches each backpropagating their mean loss undivided (their gradients add up "
        "over the K backwards), or the whole batch's cached loss backpropagated in each of the K "
        "passes where it belongs once. Fix: " + _ACCUMULATION_FIX + ". In a pipeline (K its "
        "schedule's micro-batches): a schedule made with scale_grads=False on a loss_fn that "
        "returns each micro-batch's mean; fix there: scale_grads=True (the schedule's default, "
        "each gradient ÷ K), or a loss_fn that divides by the micro-batches."
    ),
    terms.Factor.ONE_OVER_W_K: (
        "a factor 1/W (a gather whose backward keeps only the own slice while every rank "
        "computes the full loss) and 1/K (the loss divided by K twice) at once, or a loss "
        "divided by the W·K micro-batches of the update on top of DDP's average over W. Fix: "
        + _GATHER_FIX
        + ", and "
        + _ACCUMULATION_FIX
        + "."
    ),
    terms.Factor.W_K: (
        "the loss multiplied by W to undo DDP's average and not divided by K, or the micro-"
        "batches' losses summed over all W·K where one device takes their mean. Fix: drop the "
        "factor W, and " + _ACCUMULATION_FIX + "."
    ),
    terms.Factor.W_OVER_K: (
        "a factor W (the loss multiplied by W on a gather whose backward already sums) and 1/K "
        "(the loss divided by K twice) at once. Fix: drop the factor W, and "
        + _ACCUMULATION_FIX
        + "."
    ),
    terms.Factor.K_OVER_W: (
        "a factor 1/W (a gather whose backward keeps only the own slice while every rank "
        "computes the full loss) and K (the micro-batches' losses not divided by K) at once. "
        "Fix: " + _GATHER_FIX + ", and " + _ACCUMULATION_FIX + "."
    ),
    terms.Factor.ONE_OVER_W_OR_K: (
        "at W = K the check cannot tell 1/W from 1/K: the same check at a W other than K names "
        "it. Of 1/W: a gather whose backward keeps only the own slice while every rank computes "
        "the full loss (fix: "
        + _GATHER_FIX
        + "); of 1/K: the loss divided by K twice (fix: "
        + _ACCUMULATION_FIX
        + ")."
    ),
    terms.Factor.W_OR_K: (
        "at W = K the check cannot tell W from K: the same check at a W other than K names it. "
        "Of W: the loss multiplied by W on a gather whose backward already sums, or a trainer "
        "that multiplies each rank's mean loss by the processes (a Hugging Face Trainer's "
        "average_tokens_across_devices; fix: drop the factor, or tell such a trainer the loss "
        "is a mean); of K: the micro-batches' losses not divided by K (fix: "
        + _ACCUMULATION_FIX
        + ")."
    ),
}


def _factor_text(factor: terms.Factor, causes: str) -> str:
    """A factor's diagnosis: what was measured (K is the micro-batches each rank accumulates),
    what the factor does under each optimizer, its usual causes (labelled) and fix."""
    return (
        "the gradient is " + factor + " times one device's (norm ratio {norm_ratio:.6g}, cosine "
        "{cosine:.12g}), K being the micro-batches each rank accumulates per update. "
        + UNIFORM_FACTOR
        + " Usual causes (not tested here): "
        + causes
    )


# What was measured, what it means, and (labelled) the usual causes, which the check does not test.
# A comparison judged in floors whose run departs only after its first update.
LATER_NOT_JUDGED = (
    "the first update is within floors of the floor recording, what follows is not (a "
    "later update's loss, or the final weights), and one "
    "floor recording cannot tell that from rounding that training amplified: an adaptive "
    "optimizer (Adam's) steps each element by about its learning rate whatever the "
    "element's size, so an element of the gradient that rounding alone sets near zero moves "
    "by the learning rate in either sign, in one run and not in another. A layout that "
    "departs after the first update (an optimizer state, a buffer updated per rank, "
    "randomness drawn after the first step) reads the same. Record both runs in float64, "
    "where every update is judged to 1e-10."
)
# A comparison judged in floors whose whole first gradient is within them and a part's is not.
PART_NOT_JUDGED = (
    "the first update's whole gradient is within floors of the floor recording and one part's is "
    "not: {part} at {floors:.3g} floors ({departure:.2g} relative), within the {ceiling:.2g} that "
    "rounding in {word} gave a correct run's part (docs/design.md §2), so one floor recording "
    "cannot tell it from rounding. Record both runs in float64, where every part is judged to "
    "1e-10."
)

DIAGNOSES = {
    terms.LOSS_DIFFERS: (
        "the loss itself is not the 1-device loss: the mean over ranks of what the ranks return "
        "differs from the loss of the whole batch (relative difference {loss_diff:.2g}); no "
        "gather's backward can make it exact: what computes the loss must change (the loss, or "
        "the model's forward before it)."
    ),
    terms.LOSS_SCALED: (
        "the global loss is {scale:.6g} times the 1-device loss on every batch compared (to a "
        "relative "
        + _FLOAT64
        + ") and the gradient is exact (max relative error {max_rel_err:.2g}): "
        "training is exact, only the logged value is scaled; divide it by the factor to compare "
        "it with one device. Usual cause (not tested here): a loss multiplied by W to undo "
        "DDP's average, on a gather whose backward keeps only the rank's own slot. Cleaner: "
        + _GATHER_FIX
        + " without the factor, which logs the 1-device value too. In a pipeline, a factor 1/K "
        "(K its schedule's micro-batches) is the logged mean of micro-batch losses that are each "
        "a part of the whole (a sum ÷ the global count of tokens): a correct run; log their sum "
        "to read one device's loss. Under a Hugging Face Trainer, a factor 1/W, 1/K or 1/(W·K) "
        "(K its gradient accumulation steps) is its model's loss over the global count of the "
        "update's tokens (num_items_in_batch), each micro-batch's a part of the whole, which the "
        "Trainer multiplies by the processes outside the model: a correct run."
    ),
    terms.GradientClass.ONE_OVER_W: (
        "the gradient is 1/W of one device's (norm ratio {norm_ratio:.6g}, cosine "
        "{cosine:.12g}): SGD's effective learning rate is "
        "divided by W, and anything added to the gradient outside the loss (L2 weight decay, "
        "another loss term) weighs W times more. Usual causes (not tested here): an all_gather "
        "without gradient with the live local tensor put back in its slot, or a gather whose "
        "backward keeps only the own slice, while every rank computes the full loss; an in-place "
        "dist.all_reduce that completes a sum over the rank's rows (a cross-correlation, a "
        "batch's statistics), which autograd does not see, while every rank computes the loss "
        "from the whole; or the loss or its gradients divided by W where DDP already averages "
        "them over the ranks. Fix: " + _GATHER_FIX + "; or drop the division by W; where every "
        "rank computes the whole global loss (GradCache's cached embeddings, or after an "
        "in-place all_reduce), multiply it by W before its backward, since DDP averages; or "
        "all-reduce in an autograd Function whose backward all-reduces the gradient too."
    ),
    terms.GradientClass.W: (
        "the gradient is W times one device's (norm ratio {norm_ratio:.6g}): SGD's effective "
        "learning rate is multiplied by W. Usual causes (not tested here): the loss multiplied "
        "by the world size to undo DDP's average, on top of a gather whose backward already sums "
        "the ranks' gradients; or a trainer that multiplies each rank's mean loss by the "
        "processes, taking it for a sum over the global batch's items (a Hugging Face Trainer's "
        "average_tokens_across_devices, for a model whose forward takes **kwargs but whose loss "
        "is the rank's mean). Fix: drop the factor (tell such a trainer the loss is a mean)."
    ),
    terms.GradientClass.BIASED: (
        "the gradient points in another direction than one device's (cosine {cosine:.6g}, norm "
        "ratio {norm_ratio:.4g}): no learning rate repairs that. Usual causes (not tested here): "
        "a loss over the rank's own rows (its anchors against the gathered batch) with a gather "
        "that drops the other ranks' gradients of this rank's slice (no gradient, or the own "
        "slice only), or a gather that averages the gathered path while the direct use of the "
        "local embeddings keeps its size; or a loss term normalised per rank where one device "
        "normalises over the global batch (a mean over the rank's own tokens, a sum over the "
        "ranks not divided by W). Fix: " + _GATHER_FIX + "; or one device's normalisation."
    ),
    terms.GradientClass.NONE: (
        "no gradient reaches the model's parameters on W ranks, while one device has one: "
        "nothing connects the loss to the model, and DDP training fails at its first backward. "
        "Usual cause (not tested here): the embeddings used only through a gather without "
        "gradient (a torch.no_grad all_gather). Fix: " + _GATHER_FIX + "; putting the live local "
        "tensor back in its slot gives 1/W."
    ),
    terms.GradientClass.OTHER: (
        "the gradient has the right direction (cosine {cosine:.12g}) but a factor that no name "
        "of the layout gives (norm ratio {norm_ratio:.6g}; named are 1/W and W, and with K "
        "micro-batches per rank 1/K, K and their products with W): some factor depends on the "
        "layout. Usual cause (not tested here): a loss divided by the local batch size in one "
        "place and by the global one in another."
    ),
    **{factor: _factor_text(factor, words) for factor, words in FACTOR_CAUSES.items()},
    terms.DIVERGES: (
        "the first step agrees with one device, a later one does not: something besides the "
        "first step's loss and gradient depends on the layout (an optimizer state, a buffer "
        "updated per rank, randomness drawn after the first step)."
    ),
    # a comparison judged in floors that cannot tell (`recordings`): `LATER_NOT_JUDGED` unless it
    # says another reason (`PART_NOT_JUDGED`)
    terms.NOT_JUDGED: "{not_judged}",
    terms.FAILED: (
        "the ranks failed ({error}): the check has no verdict at this world size; the other "
        "world sizes have theirs.{collectives_fix}"
    ),
    terms.DATA_DIFFERS: (
        "the run is not given its reference's global batch (its rows fingerprinted per update, "
        "below): no loss or gradient can be compared with the reference's while the data "
        "differs. {data_cause}"
    ),
}

# What explains a comparison's ``data differs``, read from the fingerprints
# (`check.batches.explain`), and its fix.
_SAMPLER_FIX = (
    "Fix: the same seeded sampler in both runs, gatherlab.data.LayoutInvariantSampler(dataset, "
    "global_batch_size, seed=S) at every world size, W = 1 included (a drop-in for "
    "DistributedSampler: epoch e drawn from seed + e, rank r given the r-th consecutive part of "
    "each global batch), its set_epoch(epoch) called before each epoch; under a trainer that "
    "builds its own sampler (Lightning's, Hugging Face's), the same seed on every rank and in "
    "both runs instead."
)
DATA_CAUSES = {
    "padded": (
        "From the fingerprints: {run}'s rank {rank} holds {rows} {held} at update {update} that "
        "its epoch {epoch} has given already: its sampler pads the data set with repeated rows "
        "(a DistributedSampler with drop_last=False pads its permutation to a multiple of W with "
        "its first indices; accelerate, under a Hugging Face Trainer, completes an epoch's last "
        "batches on W ranks with its first rows), so the last global batch of an epoch depends "
        "on W. Fix: under a Trainer, TrainingArguments(dataloader_drop_last=True); elsewhere "
        + _SAMPLER_FIX.removeprefix("Fix: ")
        + " Its drop_last=True (the default) drops the epoch's last n mod N rows at every W; "
        "drop_last=False completes the last global batch from the permutation's first rows, the "
        "same at every W."
    ),
    "duplicated": (
        "From the fingerprints: {run}'s rank {rank} holds {rows} {held} at update {update} that "
        "its epoch {epoch} has given already, and that {other}'s epoch {epoch} gives twice too: "
        "the data set holds these samples more than once (equal texts or inputs), and the runs "
        "group them in other batches: a batch sampler that decides per device which rows may "
        "share a batch (one that keeps a duplicate out of a batch that holds it already, as "
        "sentence-transformers' NoDuplicatesBatchSampler does) decides over N / W rows where one "
        "device decides over N. Fix: build such batches at the global batch size and cut each "
        "into the per-device batches, in order (examples/jobs/st_job.py's global_batches, through "
        "the trainer's batch_sampler hook), so that every W is given one device's."
    ),
    "foreign": (
        "From the fingerprints: {run}'s global batch at update {update} holds {rows} {held} that "
        "{other} gives at no update, although {other} covered its data set (an epoch): the "
        "inputs themselves differ, not their order: randomness drawn per process or per run (an "
        "augmentation, noise) rather than per sample, or other data or preprocessing. Fix: draw "
        "each sample's randomness from the sample itself (its index and epoch: "
        "gatherlab.components.data.sample_generator, docs/design.md §2)."
    ),
    "size": (
        "From the fingerprints: B's global batch holds {rows_b} rows an update, A's {rows_a}: "
        "the per-device batch is not A's batch over the ranks (a trainer's "
        "per_device_train_batch_size, a DataLoader's batch_size, is each rank's). Fix: give each "
        "of the W ranks A's global batch over W rows (or A the ranks' whole batch), so that every "
        "W trains on one device's global batch."
    ),
    "start": (
        "From the fingerprints: the two runs' samplers start from different permutations: "
        "already update 0's global batches differ, before any epoch ends or is padded (striding "
        "over the ranks reorders update 0's rows, padding and dropping change an epoch's end). "
        "Their seeds differ, or a sampler has no seeded generator (torch's RandomSampler(data) "
        "without generator= draws a new permutation from torch's global RNG in every run), or "
        "one run does not shuffle. " + _SAMPLER_FIX
    ),
    "unseen": (
        "From the fingerprints: none of the {rows} {held} of B's global batch at update {update} "
        "that A's lacks appears at any update of A, and A's recording does not cover its data "
        "set, so the fingerprints cannot tell a sampler that starts from another permutation "
        "(rows A had not reached yet) from inputs that differ themselves (another preprocessing "
        "or tokenization, randomness drawn per process or per run). Record more updates than an "
        "epoch to tell them apart. " + _SAMPLER_FIX
    ),
    "reshuffled": (
        "From the fingerprints: both runs give the same global batches until update {update}"
        "{strided}, where both start epoch {epoch} (its rows repeat epoch {previous}'s): they "
        "reshuffle differently between epochs. {repeats}A sampler that continues its generator "
        "into the next epoch (RandomSampler) and one that draws each epoch from seed + epoch "
        "(DistributedSampler.set_epoch) agree on the first epoch only. " + _SAMPLER_FIX
    ),
    "epochs": (
        "From the fingerprints: A's first epoch gives {rows_a} rows in {updates_a} updates, B's "
        "{rows_b} in {updates_b}: the runs drop or pad different remainders of the data set "
        "(drop_last, or a DistributedSampler's drop or padding to a multiple of W), so their "
        "global batches are cut differently from there. " + _SAMPLER_FIX
    ),
    "unexplained": (
        "From the fingerprints: the runs part at update {update}, inside epoch {epoch}, with no "
        "row held twice, no new epoch and no row foreign to the other run: an order that depends "
        "on W is left (a sampler or batch sampler of the job's own, a data loader's workers "
        "yielding out of order). " + _SAMPLER_FIX
    ),
}
# A recorded run that accumulates K micro-batches per update where its reference takes each global
# batch at once, and whose loss differs (the recording measures K, not the cause).
RECORDED_MICRO_BATCHES = (
    "B accumulates {micro_batches} micro-batches per update (the losses each rank recorded in "
    "it), A takes each global batch at once: a loss whose rows meet (in-batch negatives, a "
    "statistic of the batch) sees only its micro-batch's, which no scaling repairs (the class "
    'micro_negatives, docs/design.md §2, "Micro-batches"); a cached form computes it over the '
    "whole batch with the same memory (GradCache: the loss embeds the batch in mini-batches "
    "without gradients, then re-embeds each with its cached gradient), the trainer accumulating "
    "nothing."
)
# B's job clips its gradient (a trainer's max_grad_norm, in its recording's header), and B's norm
# at the first departing update is that bound (`check.recordings._clipped`).
CLIPPED = (
    "B clips its gradient (max_grad_norm {bound:g} in its recording): its norm at update {update} "
    "is {norm:.6g}, the bound, where A's is {norm_a:.6g}, so the factor read is that of B's "
    "gradient after clipping, not of the gradient its loss gives (a layout's factor, W or 1/W, "
    "clipped to the bound reads as another). Record both runs with clipping off "
    "(max_grad_norm=0) to read that factor; a Hugging Face Trainer's loss at W ranks is W times "
    "one device's unless the model's loss is a mean over the global tokens (docs/usage.md)."
)
# A run whose epoch repeats the previous epoch's order (its sampler never told the epoch).
DATA_REPEATS = (
    "{run} gives epoch {epoch} in epoch {previous}'s order: its sampler is never told the new "
    "epoch (DistributedSampler.set_epoch(epoch) is not called). "
)
# B held A's rows strided over its ranks before they parted: a DistributedSampler's order.
DATA_STRIDED = " (B's ranks holding A's rows strided over them, a DistributedSampler's order)"
# The note of a global batch that holds the reference's rows in another order (not a failure).
OTHER_ORDER = (
    "note: update {update} gives the same global batch in another order ({updates} of "
    "{total} updates): a loss that pairs rows by position sees other pairs, a mean over the "
    "rows does not."
)
# A recording without the loss of some updates (the job gave its recorder none).
NO_LOSS = (
    "note: {updates} of {total} updates have no recorded loss in A or B (the recorder found no "
    "loss module, no output's loss and no recorder.loss(value)): their losses are not compared, "
    "their gradients are."
)
# A float64 recording whose loss tensor was of a narrower dtype (`check.recordings._loss_rounding`).
LOSS_ROUNDED = (
    "note: the job's loss is a {dtype} number (its loss tensor's dtype), which one device and W "
    "ranks round otherwise: the losses are held to {rounding:.2g} ({units} unit roundoffs of "
    "{dtype} of A's largest loss), the gradients and weights to float64's bound."
)
# A floor recording (``--floor``) that departs from A beyond any rounding of the precision.
NO_ROUNDING_FLOOR = (
    "note: the floor recording {floor} departs from A by {departure:.2g} (relative) at update 0, "
    "beyond any rounding of {word} (at most {ceiling:.2g}): its forward is not A's up to rounding "
    "(a random draw, dropout say, that its row blocks draw otherwise), so it is no floor; B is "
    "judged without it. For a floor, record A and its floor with nothing drawn at random in the "
    "forward (dropout off), or compare in float64."
)
# The fix of a gradient nothing reduces over the ranks, but where the measured words give another.
UNREDUCED_FIX = (
    " Fix: put the parameter inside the module DDP or FSDP wraps and use it in that module's "
    "forward, so that its gradient is reduced with the others, or all-reduce its gradient (the "
    "mean over ranks) before the optimizer's step."
)
# The same under ZeroRedundancyOptimizer, whose ranks each step their own shard with the gradient
# they hold: a gradient DDP reduced and then scaled per rank differs as an unreduced one does.
ZERO_UNREDUCED_FIX = (
    " Under ZeroRedundancyOptimizer each rank steps only its own shard of the parameters, with the "
    "gradient it holds: one that DDP reduced and each rank then scaled by a number of its own (a "
    "clip_grad_norm_ whose norm is taken over the rank's own parameters or shard, a loss scale "
    "per rank) differs between the ranks just so. Fix: take that number over the whole gradient "
    "(clip_grad_norm_ over every parameter: DDP gives every rank the whole reduced gradient); "
    "a parameter outside the module DDP wraps is reduced by putting it inside, or by an "
    "all-reduce (the mean over ranks) of its gradient before the optimizer's step."
)
# An unreduced part of a tensor-parallel recording whose sum over each group is A's, measured, and
# where none is (`check.recordings._unreduced`).
TENSOR_PARALLEL_SUMMED = (
    "The sum over each tensor-parallel group's ranks ({groups}) of {part}'s gradients is A's "
    "(update {update}, relative difference {error:.2g} of the sketches): each rank holds a "
    "partial gradient of a weight its group replicates (a norm under sequence parallelism, its "
    "input the rank's shard of the sequence); summing it over the group is the fix "
    "(SequenceParallel() on it in the plan), not DDP's mean."
)
TENSOR_PARALLEL_PARTIAL = (
    "B is tensor-parallel (groups {groups}), and the ranks of a group must compute the same "
    "gradient of a weight the group replicates. Usual causes (not tested here): the weight's "
    "gradient computed from the rank's own shard (a norm under sequence parallelism) is a "
    "partial gradient, which the group sums, not averages: declare it in the plan "
    "(SequenceParallel() on the norm), or all-reduce its gradient with a sum over the group; "
    "the group's ranks compute different losses (code that depends on the rank, rows of their "
    "own): give every rank of a group the same; or each rank scales its gradient by a number of "
    "its own, as clipping by the norm of the rank's own shards does: clip by the whole "
    "gradient's norm, the square root of the sum of every parameter's squared gradient norm, a "
    "DTensor's read whole (grad.full_tensor(); torch.nn.utils.clip_grad_norm_ takes it where "
    "every parameter is a DTensor, and refuses a mix of plain tensors and DTensors)."
)
# Not judged, where the floor recording given was set aside (`check.recordings._not_judged_words`).
FLOOR_SET_ASIDE = (
    "The floor recording given is no floor (the note above): record A and its floor again with "
    "nothing drawn at random in the forward (dropout off) and compare with that floor, or record "
    "both runs in float64."
)
# A floor recording whose calls of the forward do not span B's (`check.recordings._floor`).
CALLS_UNSPANNED = (
    "note: B's calls of the model's forward hold {b} rows a rank, and the floor recording rounds "
    "as calls of {least} to {most} rows (A's calls in its row blocks): the matrix kernels round "
    "calls of other sizes otherwise, which it never measured, so at most {threshold:g} floors is "
    "within it, not 5 (docs/design.md §2). A floor whose calls span B's keeps 5: A's chunks no "
    "smaller than B's per rank, in as many row blocks as the floor needs to reach B's "
    "(GATHERLAB_RECORD_FLOOR_BLOCKS{blocks})."
)
# The same, where rank r holds the reference's rows r, r + W, …: a strided sampler's order.
STRIDED_ORDER = (
    "note: the global batch holds the reference's rows strided over the ranks (rank r its rows "
    "r, r + {world_size}, r + 2·{world_size}, …; at {updates} of {total} updates), as a "
    "DistributedSampler deals them: the same rows in another order."
)
# The same, where each rank holds its part of each of the reference's blocks (views concatenated
# per rank before the forward, or K micro-batches in turn): the order every layout gives them.
BLOCK_ORDER = (
    "note: the model's input rows are the reference's, each rank holding its part of each of "
    "its {blocks} blocks in turn (at {updates} of {total} updates): {blocks} views or "
    "micro-batches taken per rank in turn, the order any layout gives them."
)

# A cause a comparison of recordings names from what they hold (``gatherlab.check.recordings``): a
# recording cannot reproduce a loss on one device, so each says what in the recordings shows it.
RECORDED_CAUSES = {
    terms.Cause.SCALED: (
        "Read from the recordings: B's global loss of update 0, computed at A's weights on A's "
        "rows, is {scale:.6g} times A's, and its gradient {gradient} (norm ratio "
        "{norm_ratio:.6g}, cosine {cosine:.12g}): a factor that depends on the layout scales the "
        "loss, e.g. a loss divided by W on top of DDP's average, a sum over the rank's rows where "
        "one device sums over all of them (reduction='sum': c = 1/W), multiplied by W on a "
        "gather whose backward already sums the ranks' gradients, or K micro-batches' losses not "
        "divided by K (c = K). Fix: drop the factor (a mean over the rows, or a sum divided by "
        "the global batch's count); divide by K exactly once per update."
    ),
    terms.Cause.LOCAL_NEGATIVES: (
        "Named from the traces of the first update (below: where it departs; a recording cannot "
        "reproduce it on one device): the first result that leaves one device's reduces over "
        "the rank's part of the entries its rows meet, where one device takes them all. Each "
        "rank's loss sees only its own rows as its negatives (or targets): they are local. Fix: "
        "gather every rank's embeddings through " + _GATHER_FIX + ", and compute the loss over "
        "the gathered batch; a library's loss that has an option to gather across devices does "
        "it when the option is set."
    ),
    terms.Cause.LOCAL_STATISTIC: (
        "Named from the traces of the first update (below: where it departs; a recording cannot "
        "reproduce it on one device): the first result that leaves one device's takes a "
        "statistic over the rank's own rows where one device takes all of them (a batch norm, or "
        "a mean or standard deviation over the batch). Fix: a batch norm synchronised over the "
        "ranks (torch.nn.SyncBatchNorm.convert_sync_batchnorm, on GPUs), or the statistic taken "
        "over the gathered batch (gathered through " + _GATHER_FIX + "), or its sums and counts "
        "all-reduced before dividing."
    ),
    terms.Cause.MICRO_NEGATIVES: (
        "Named from the traces of the first update (below: where it departs; a recording cannot "
        "reproduce it on one device): B accumulates {micro_batches} micro-batches per update, "
        "and the first result that leaves one device's reduces over the micro-batch's part of "
        "the entries its rows meet. Each micro-batch's loss sees only its own rows as its "
        "negatives: naive accumulation. Fix: accumulate through a feature cache (GradCache: "
        "every micro-batch's embeddings without gradient, the whole batch's loss and its "
        "gradient with respect to them, then one recomputation per micro-batch backpropagating "
        "it), the embeddings gathered across ranks through " + _GATHER_FIX + "."
    ),
}
# A recorded run judged in floors whose first loss reads the same and whose gradient departs.
LOSS_UNRESOLVED = (
    "In {word} the first loss is held to {threshold:g} floors of the floor recording's "
    "({resolution:.1e} relative): a loss that differs by less (its labels or a term, say) reads "
    "the same here and shows only in the gradient, so the usual causes above are not all there "
    "is; compare float64 recordings to tell a loss that differs from a gradient that does."
)
# A recorded run judged without a floor, beyond any rounding (`check.recordings._ceiling`), whose
# gradient reads `other` at that coarse resolution.
CEILING_OTHER = (
    "Read without a floor recording, at the resolution of any rounding in {word} ({resolution:.2g} "
    "relative), a direction this close to one device's (cosine {cosine:.6g}) may be another one: "
    "the usual cause above is a guess; compare with A's floor recording (--floor) to tell a "
    "factor from another direction."
)
# A recorded run whose loss differs with no cause named and no traces to name one by.
RECORDED_UNTRACED = (
    "The recordings cannot tell which part of the forward departs: a loss whose rows meet only "
    "its rank's rows (in-batch negatives local to a rank{micro}), a statistic of the rank's rows "
    "(a batch norm, a mixture of experts' load-balancing loss over the rank's tokens), randomness "
    "drawn per rank (dropout) or code that depends on the rank give "
    "the same numbers here. Record both runs with trace=True (gatherlab.record(..., trace=True), "
    "or the callbacks' trace=True; in float64, where a low precision's results would part by "
    "rounding everywhere) and compare again: the first operation that departs is named with its "
    "line, but for a cached, GradCache-style loss, which runs the model again inside its forward "
    "or backward, where no trace can follow it; or check the step itself with python -m "
    "gatherlab.check."
)
# The same, for a B whose ranks train a tensor-parallel model (its recording's row groups).
RECORDED_TENSOR_PARALLEL = (
    "The recordings cannot tell which part of the forward departs: a loss over the rank's shard "
    "of the logits or rows (a tensor-parallel output read as a local tensor{micro}), a statistic "
    "of them, randomness drawn per rank or code that depends on the rank give the same numbers "
    "here, and a trace does not follow a tensor-parallel model's DTensors. Check the step itself "
    "with python -m gatherlab.check --step ... --tensor-parallel T, which reads each operation's "
    "shards against one device's and names its line."
)

# What reproduced a ``loss differs`` on one device (``gatherlab.check.hypotheses``), and its fix.
CAUSES = {
    terms.Cause.SCALED: (
        "The global loss is {scale:.6g} times the 1-device loss at the same weights (to a "
        "relative " + _FLOAT64 + ": reproduced on one device on both batches checked for a loss, "
        "read from the first step of a training run), while the gradient is {gradient} (norm "
        "ratio "
        "{norm_ratio:.6g}, cosine {cosine:.12g}): a factor that depends on the layout (W ranks, "
        "K micro-batches accumulated per rank) scales the loss and its gradient is not one "
        "device's either, e.g. a loss multiplied by W on a gather whose backward already sums "
        "the ranks' gradients, or K micro-batches' losses not divided by K (c = K) or divided by "
        "K twice (c = 1/K). Fix: drop the factor; divide by K exactly once per update."
    ),
    terms.Cause.LOCAL_NEGATIVES: (
        "Reproduced on one device to a relative " + _FLOAT64 + " on both batches checked: the "
        "global loss "
        "is the mean over ranks of the 1-device loss of each rank's slice alone. Each rank's "
        "loss sees only its own rows: its negatives, targets or batch statistics are local. Fix: "
        "gather every rank's embeddings through " + _GATHER_FIX + ", and compute the loss, or "
        "its statistics, over the gathered batch; a library's loss that has an option to gather "
        "across devices does it when the option is set."
    ),
    terms.Cause.MICRO_NEGATIVES: (
        "Reproduced on one device: the global loss is the mean over the micro-batches of the "
        "1-device loss of each micro-batch's rows alone (a rank's micro-batch k: the (r·K + "
        "k)-th block of N/(W·K) rows; or, for a loss that gathers each micro-batch over the "
        "ranks, the k-th micro-batch of every rank together). That is naive accumulation: each "
        "micro-batch's loss sees only its own rows as negatives, targets or batch statistics. "
        "Fix: accumulate through a feature cache (GradCache-style: every micro-batch's "
        "embeddings without gradient, the whole batch's loss and its gradient with respect to "
        "the embeddings, then one recomputation per micro-batch backpropagating that gradient), "
        "with the embeddings gathered across ranks through " + _GATHER_FIX + "."
    ),
    terms.Cause.PAIR_ORDER: (
        "Reproduced on one device to a relative " + _FLOAT64 + " on both batches checked: the "
        "global loss "
        "is the 1-device loss of the rows in the order that concatenating the two views per rank "
        "and then gathering produces ([view 0 of rank 0; view 1 of rank 0; view 0 of rank 1; "
        "…]). The loss pairs rows by position as if the gathered tensor were view-major, so its "
        "positives are other samples' rows. Fix: gather each view separately, or reorder the "
        "gathered rows to [every rank's view 0; every rank's view 1] before pairing."
    ),
    terms.Cause.LOCAL_STATISTIC: (
        "None of the causes the check reproduces on one device (scaled, local_negatives, "
        "pair_order) gives the global loss; followed operation by operation (below: where it "
        "departs), the first whose result leaves one device's takes a statistic over the rank's "
        "own rows where one device takes all of them (a mean, a standard deviation, a softmax or "
        "a batch norm over the batch). Fix: take it over the gathered batch (gathered through "
        + _GATHER_FIX
        + "), or all-reduce its sums and counts before dividing."
    ),
    terms.Cause.UNREDUCED: (
        "Measured {unreduced_source}: the gradient of {unreduced} differs between the run's ranks "
        "({unreduced_updates}): it is not reduced over the ranks, so each rank's optimizer steps "
        "with its own gradient (the run's gradient shown is rank 0's). {unreduced_mean}"
        "{unreduced_fix}"
    ),
    terms.Cause.COPIES_APART: (
        "Measured on the ranks, from the copies alone: {copies}. One device holds one such "
        "parameter; its copies on the pipeline's stages (a weight one device ties, an embedding "
        "on the first stage and its head on the last; or a stage's data-parallel replicas; or "
        "an expert's replicas, the ranks of its mesh['dp'] group, under expert parallelism) "
        "each stepped with their own gradient, the part of one device's gradient that reaches "
        "their stage (the gradient of the first holder is the run's). Fix: sum the tied copies' "
        "gradients over the ranks that hold them before the optimizer's step (dist.all_reduce("
        "p.grad, group=mesh['pp'].get_group()), a rank without a copy adding zeros), and "
        "reduce the replicas' over mesh['dp'] as the loss is divided: their mean where each "
        "replica's loss is the mean over its own rows, their sum where each divides by the "
        "global batch's count (an expert's likewise over the ranks that hold it)."
    ),
    terms.Cause.MICRO_SCALE: (
        "Measured: every part's gradient is the same factor of one device's (cosine 1), a factor "
        "of the pipeline's K micro-batches. Its schedule adds the K micro-batches' gradients and "
        "divides them by K where scale_grads=True (its default): a loss_fn that returns each "
        "micro-batch's mean under scale_grads=False gives K times one device's gradient, and one "
        "that already divides by the micro-batches (a sum ÷ the global count of tokens) under "
        "scale_grads=True gives 1/K. Fix: divide once, by the schedule or by the loss_fn: "
        "scale_grads=True with a per-micro-batch mean over equal counts, or scale_grads=False "
        "with a loss_fn that sums and divides by the global count."
    ),
    terms.Cause.MICRO_MEAN: (
        "Reproduced on one device: the first global loss is the mean over the pipeline's "
        "micro-batches of the 1-device loss of each micro-batch's rows alone. Each micro-batch's "
        "loss is a mean over its own rows or tokens: with padding (ignore_index) the micro-"
        "batches hold different counts of tokens, and the mean of their means weighs a token of "
        "a short micro-batch more than one device's mean over every token does (its gradient "
        "too). Fix: a loss_fn that sums over the micro-batch's tokens and divides by the count "
        "of every micro-batch's tokens (reduction='sum' / the global count, all-reduced over "
        "mesh['dp']), with scale_grads=False; its logged loss is then the sum of the "
        "micro-batches' losses."
    ),
    terms.Cause.PARTIAL: (
        "Measured on the ranks: each of {partial} is replicated over the mesh's {partial_over} "
        "dimension and its gradient there is a partial sum (a DTensor Partial(sum), as a "
        "sequence-parallel LayerNorm's is: each rank holds the sum over its shard of the "
        "sequence), and its replicas end the run apart: something steps each rank with the "
        "gradient's local tensor (to_local()), its own partial sum{partial_stepped_by}. "
        "{partial_reduced} Fix: make the sum whole before reading a gradient's local tensor "
        "(grad.redistribute(grad.device_mesh, [Replicate()]) or grad.full_tensor(), "
        "torch.distributed.tensor), or let torch's optimizers step the DTensor parameters."
    ),
    terms.Cause.LAYOUT: (
        "Measured on the ranks: a tensor of the tensor-parallel model does not have, over the "
        "ranks, the shape one device's has (where the run departs, below, names it): the code "
        "takes a shard for the whole, or the whole for a shard."
    ),
    terms.Cause.SHARD_AS_WHOLE: (
        "Measured on the ranks: an operation of the tensor-parallel model's first forward gives, "
        "on a rank, a result that is neither one device's result nor its shard (one device's "
        "chunk at the rank's tensor-parallel index along one dimension), though the shapes may "
        "agree: the code takes the rank's shard for the whole (where the run departs, below, "
        "names the operation and the fix)."
    ),
    terms.Cause.LOCAL_TOKENS: (
        "Reproduced on one device: the first loss of the expert-parallel run is the mean over "
        "ranks of one device's loss on each rank's rows alone. Something of the routing is "
        "computed over the rank's own tokens where one device takes the global batch: a "
        "load-balancing (auxiliary) loss whose expert fractions and mean probabilities are the "
        "rank's, or an expert's capacity (capacity factor × tokens / experts) counted on the "
        "rank's tokens, which drops other tokens. Fix: all-reduce the counts and the summed "
        "router probabilities over every rank before the load-balancing loss (the "
        "probabilities through an all-reduce whose backward is again an all-reduce), and count "
        "a token's place in its expert's queue after the tokens of the ranks before its own, "
        "against a capacity of the global batch's tokens."
    ),
    terms.Cause.EXPERTS_MIXED: (
        "Measured from the ranks' pieces of the first gradient: two experts held by different "
        "ranks got one gradient where one device's differ (named at the end): "
        "each expert's gradient was reduced together with the gradients of other experts, over "
        "ranks that hold other experts at its place: every parameter all-reduced over all ranks, "
        "or the model in DDP over all ranks (whose broadcast also gives every rank rank 0's "
        "experts' weights). Fix: reduce each expert's gradient over its replicas only (the "
        "ranks of its mesh['dp'] group), and the replicated parameters over all ranks; no DDP "
        "around the experts."
    ),
    terms.Cause.EXPERTS_SCALED: (
        "Measured from the ranks' pieces of the first gradient: the experts' gradient is a "
        "constant times one device's while every parameter all ranks hold is exact (named at "
        "the end): the experts' reduction divides by another count. A "
        "rank's expert already sums, through the all-to-all's backward, the gradients of every "
        "token its ep group sent it; averaged over its W/E replicas it is E times one device's. "
        "Fix: sum each expert's gradient over its replicas (mesh['dp']) and divide by W, the "
        "number of ranks whose losses one device's averages (DeepSpeed's and Megatron-LM's "
        "expert scaling)."
    ),
    terms.Cause.DESYNC: (
        "Measured from the recording: the run's ranks end update {desync_update} with different "
        "weights ({desync_parts}; each rank's fingerprint of its weights after the step "
        "recorded): they step apart, silently, and from there each rank trains a model of its "
        "own, whatever the gradient rank 0 shows. Usual causes: a learning rate, schedule or "
        "optimizer state that differs between ranks (a scheduler stepped on one rank, a rank's "
        "own warm-up), a parameter changed outside the optimizer on some ranks, randomness drawn "
        "per rank in the update. Fix: make every rank's step the same function of the reduced "
        "gradient: one schedule, the optimizer's state built alike, no per-rank change of the "
        "weights."
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
    terms.GradientClass.EXACT: (
        "a part that is exact gets the 1-device gradient on every rank, e.g. a parameter of the "
        "loss used after the gather, alike on every rank (DDP's average of identical gradients "
        "is that gradient)"
    ),
    terms.GradientClass.ONE_OVER_W: (
        "a part at 1/W gets its gradient only through the rank's own slice of the gathered "
        "embeddings (usually, not tested here: a gather whose backward keeps only its own slice, "
        "or a no-grad gather with the live local tensor in its slot, while every rank computes "
        "the full loss)"
    ),
    terms.GradientClass.W: (
        "a part at W gets W times one device's gradient (usually: a factor of W in the loss)"
    ),
    terms.GradientClass.NONE: (
        "a part with no gradient where one device has one is reached only through a gather "
        "without gradient (one with none on one device either trains on neither)"
    ),
    terms.Factor.K: (
        "a part at K gets K times one device's gradient (usually, not tested here: a parameter "
        "of the loss, such as a learnt temperature, accumulated once per micro-batch: the whole "
        "batch's loss recomputed in each of the K passes of a cached accumulation, where its "
        "gradient belongs once)"
    ),
    terms.Factor.ONE_OVER_K: (
        "a part at 1/K gets 1/K of one device's gradient (usually, not tested here: its loss "
        "divided by K where its gradient is already the whole batch's, as in a cached "
        "recomputation)"
    ),
    **{
        factor: f"a part at {factor} carries both of its factors (the words of the whole gradient "
        f"at {factor} say which causes give each)"
        for factor in terms.Factor
        if factor not in (terms.Factor.K, terms.Factor.ONE_OVER_K)
    },
}
# What each culprit of docs/checking.md §10 means, and its fix (the check of a training step): the
# cause each removal takes out (its own words), the step's randomness, and the loss, which remains
# when all of them are made.
CULPRIT_DIAGNOSES = {
    **{removal: removal.diagnosis for removal in Removal},
    Culprit.STEP_RANDOMNESS: (
        "the training step draws from the global random streams (measured: its first loss on "
        "one device changes when only the streams' seed changes, dropout layers off), e.g. "
        "augmentations applied to the batch in the step: W ranks draw other numbers for a sample "
        "than one device, and no removal takes that out (with it, the check cannot see whether "
        "the loss is exact too). Fix: draw each sample's randomness from a generator seeded by "
        "(seed, step, sample index), e.g. torch.Generator().manual_seed(...) per sample, or "
        "augment in the data set and check with the data_randomness removal."
    ),
    Culprit.UNREDUCED: (
        "a parameter's gradient differs between the ranks (measured: every rank's first gradient "
        "of each part against rank 0's): nothing reduces it, because neither DDP nor FSDP holds "
        "it, or because DDP's reducer waited for a parameter its forward does not use and "
        "averaged nothing. Each rank's optimizer steps with its own gradient. Reduced (all-reduced "
        "after each backward, the mean over ranks; or DDP built with find_unused_parameters=True), "
        "the run is exact (reproduced). Fix: put the parameter inside the module DDP or FSDP wraps "
        "and use it in that module's forward, or all-reduce its gradient before the optimizer's "
        "step."
    ),
    Culprit.COPIES_APART: (
        "copies of one device's parameter held on several ranks of a pipeline (a tied weight on "
        "two stages, a stage's replicas), or an expert's replicas, end the run apart (measured: "
        "every rank's copies against the first holder's, to float64's 1e-10 of its largest; an "
        "expert's, of their first gradients): nothing sums or "
        "averages their gradients over their holders, and no removal changes that. Fix: "
        "all-reduce the tied copies' gradients over the pipeline (a sum) and the replicas' over "
        "its data-parallel group (a mean where each replica's loss is the mean over its own "
        "rows, a sum where each divides by the global batch's count) before the optimizer's "
        "step."
    ),
    Culprit.PARTIAL: (
        "a replicated parameter's gradient is a partial sum over a tensor-parallel mesh "
        "dimension and is stepped unreduced: its replicas end apart (measured on the ranks). "
        "With the sum made whole before each step, the run is exact (reproduced). Fix: "
        "grad.redistribute(grad.device_mesh, [Replicate()]) or grad.full_tensor() before using "
        "its local tensor, or torch's optimizers on the DTensor parameters."
    ),
    Culprit.LAYOUT: (
        "a tensor of the tensor-parallel model has, over the ranks, another shape than one "
        "device's (measured: each module's input and the model's output on rank 0 against one "
        "device's): the code takes a shard for the whole or the whole for a shard, and no "
        "removal changes that. Where it departs names the tensor and the fix."
    ),
    Culprit.SHARD_AS_WHOLE: (
        "an operation of the tensor-parallel model computes with the rank's shard as if it were "
        "the whole tensor (measured: each result of the first forward on every rank against one "
        "device's, whole or its shard at the rank's tensor-parallel index): a reshape sized by "
        "the model's count where the rank holds a part, a statistic of the rank's part of a "
        "dimension. No removal changes that. Where it departs names the operation and the fix."
    ),
    Culprit.LOCAL_TOKENS: (
        "the expert-parallel run's routing statistics (a load-balancing loss, an expert's "
        "capacity) are computed over each rank's own tokens (reproduced: one device's loss on "
        "each rank's rows alone gives its first loss). No removal changes that."
    ),
    Culprit.EXPERTS_MIXED: (
        "experts held by different ranks get one gradient (measured from the ranks' pieces): "
        "their gradients are reduced over ranks that hold other experts. No removal changes that."
    ),
    Culprit.EXPERTS_SCALED: (
        "the experts' gradient is a constant times one device's, the replicated parameters exact "
        "(measured from the ranks' pieces): the experts' reduction divides by another count than "
        "W. No removal changes that."
    ),
    Culprit.LOSS: (
        "no removal (of batch norm, dropout or the data's randomness, where the model has them) "
        "makes the run exact: the loss itself, or how it communicates across ranks (its gather), "
        "breaks it."
    ),
}


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


# What fixes ranks whose collectives differ (``gatherlab.ranks.watched``).
_COLLECTIVES_FIX = (
    " Every rank must enter the same collectives in the same order, with tensors of the same "
    "shape and dtype: the calls named above depend on the rank (a branch on the rank, a return "
    "before a collective its peers enter)."
)


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
    differ = rows["error"].astype(str).str.startswith(terms.COLLECTIVES_DIFFER).any()
    numbers["collectives_fix"] = _COLLECTIVES_FIX if differ else ""
    return numbers


def _parts_text(parts: pd.DataFrame) -> str:
    """What the parts of a biased gradient measured, and what each class among them says."""
    measured = []
    for part, rows in parts.groupby("part", sort=False):
        classes = "/".join(rows["gradient"].unique())
        numbers = _PerWorldSize(rows["norm_ratio"])
        cosines = _PerWorldSize(rows["cosine"])
        measured.append(f"{part} {classes} (norm ratio {numbers:.10g}; cosine {cosines:.12g})")
    classes = set(parts["gradient"].unique())
    meanings = [PART_MEANINGS[c] for c in parts["gradient"].unique() if c in PART_MEANINGS]
    accumulation_only = {terms.GradientClass.EXACT, terms.Factor.K, terms.Factor.ONE_OVER_K}
    fixes = [] if classes <= accumulation_only else [_GATHER_FIX]
    fixes += [_ACCUMULATION_FIX] if classes & set(terms.Factor) else []
    return (
        "Measured per part: " + "; ".join(measured) + ". The parts carry different factors of "
        "one device's gradient, so their sum points elsewhere. "
        + "; ".join(meanings).capitalize()[:1]
        + "; ".join(meanings)[1:]
        + ". "
        + PART_FACTORS
        + " Fix: "
        + "; and ".join(fixes)
        + ": then every part is exact."
    )


_EXPERT_CAUSES = (terms.Cause.EXPERTS_MIXED, terms.Cause.EXPERTS_SCALED)


def diagnosis(
    rows: pd.DataFrame, parts: pd.DataFrame | None = None, measured: dict[str, Any] | None = None
) -> str:
    """What the rows (one loss and gather, one verdict and cause, their world sizes) measured,
    what reproduced it or what its parts show, and what would make it exact; ``measured``: the
    words a comparison of recordings adds to its placeholders (``data_cause``, ``unreduced``,
    …, `gatherlab.check.recordings`)."""
    first = rows.iloc[0]
    numbers = {"data_cause": "", "unreduced_fix": UNREDUCED_FIX, "not_judged": LATER_NOT_JUDGED,
               **_numbers(rows), **(measured or {})}  # fmt: skip
    nothing = first["verdict"] == terms.GradientClass.NONE and rows["norm_ratio"].isna().all()
    text = (TRAINS_NOTHING if nothing else DIAGNOSES[first["verdict"]]).format(**numbers)
    cause = first["cause"]
    if cause == terms.Cause.COPIES_APART:
        numbers["copies"] = "; ".join(rows["departs"].dropna().astype(str).unique())
    measured_causes = (terms.Cause.UNREDUCED, terms.Cause.DESYNC, terms.Cause.PARTIAL,
                       terms.Cause.COPIES_APART, terms.Cause.MICRO_SCALE)  # fmt: skip
    if cause in measured_causes:  # measured
        text = (
            f"the gradient is {first['gradient']} against one device's (cosine "
            f"{numbers['cosine']:.6g}, norm ratio {numbers['norm_ratio']:.4g}). "
            + CAUSES[terms.Cause(cause)].format(**numbers)
        )
    elif first["verdict"] == terms.LOSS_DIFFERS and cause:
        causes = RECORDED_CAUSES if numbers.get("recorded") and cause in RECORDED_CAUSES else CAUSES
        text += " " + causes[terms.Cause(cause)].format(**numbers)
    elif cause in _EXPERT_CAUSES:  # measured from an expert-parallel run's pieces
        text = (
            f"the gradient is {first['gradient']} against one device's (cosine "
            f"{numbers['cosine']:.6g}, norm ratio {numbers['norm_ratio']:.4g}). "
            + CAUSES[terms.Cause(cause)].format(**numbers)
        )
    elif cause == terms.Cause.PARTS and parts is not None and len(parts):
        text = (
            f"the gradient points in another direction than one device's (cosine "
            f"{numbers['cosine']:.6g}, norm ratio {numbers['norm_ratio']:.4g}). "
            + _parts_text(parts)
        )
    if cause in _EXPERT_CAUSES and isinstance(first.get("departs"), str):
        text += f" Measured: {first['departs']}."
    return text


# The words of a one-device reference that says more than its ``reference`` column (docs/checking.md
# §6): it needed a process group, or it runs otherwise inside one than without.
NEEDED_A_GROUP = (
    "its one-device reference ran in a one-rank process group: without one it raises {why}"
)
GROUP_DIFFERS = (
    "this {what} trains differently on one device inside a process group than without one: "
    "{differs}; the W-rank runs are judged against the plain run (no group)."
)


def _via(gather: str) -> str:
    """How a loss's heading names its gather: nothing for one that communicates by itself."""
    return "" if gather in ("native", "") else f" with gather {gather}"


def _reference_notes(result: CheckResult, what: str, heading: Any = None) -> list[str]:
    """The printed paragraphs of each loss's (or step's) reference notes
    (`CheckResult.reference_notes`), headed ``heading(name)`` (the name itself by default)."""
    lines = []
    for name, notes in result.reference_notes.items():
        title = name if heading is None else heading(name)
        if notes.why:
            text = NEEDED_A_GROUP.format(why=notes.why).rstrip(".") + "."
            lines.append(f"{title}: reference in a one-rank process group\n{_paragraph(text)}")
        if notes.group_differs:
            text = GROUP_DIFFERS.format(what=what, differs=notes.group_differs)
            lines.append(f"{title}: differs in a one-rank process group\n{_paragraph(text)}")
    return lines


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


def _precision_lines(
    checked: CheckResult | pd.DataFrame, name_column: str | None, threshold: float = FLOOR_THRESHOLD
) -> list[str]:
    """The paragraph of a check in a low precision (`table.PRECISION_COLUMNS`): what judges each
    loss (or the step) and why, its W-rank runs in floors of that precision (at most
    ``threshold`` of them exact within it: a comparison of recordings passes its own T), and what
    that precision cannot see (docs/design.md §2, "Low precision"); none for a float64 check."""
    result = result_of(checked)
    table = result.table
    if "in_precision" not in table.columns:  # float64, or a low precision without a floor
        notes = result.precision_notes.values()
        return [f"Low precision:\n{_paragraph(words + '.')}" for words in notes]
    whole = table[(table["part"] == ALL_PARTS) & table["in_precision"].map(_filled)]
    if "removed" in whole.columns:
        whole = whole[whole["removed"] == NONE]
    if not len(whole):
        return []
    precision = terms.Precision(whole["precision"].iloc[0])
    notes = result.precision_notes
    own = [f"{f'loss {name}: ' if name_column else ''}{words}." for name, words in notes.items()]
    in_float64 = whole["judged_in"] == terms.Precision.FLOAT64
    if in_float64.any():
        which = (
            f" ({', '.join(dict.fromkeys(whole.loc[in_float64, name_column]))})"
            if name_column and not in_float64.all() else ""
        )  # fmt: skip
        own.insert(0, f"The code runs in float64{which}, which judges it; {precision.word} adds "
                      "only its own rounding, measured here.")  # fmt: skip
    floored = Floored(str(precision), "", "", float(whole["floor"].max()), 0.0, 0, 0, 0,
                      threshold)  # fmt: skip
    text = " ".join([
        *own, f"Each W's gradient in {precision} is compared with one device's in {precision}, "
        f"in floors (one device with its forward in as many row blocks as W's ranks, at least "
        f"{FLOOR_ROW_BLOCKS}: rounding of the same kind, nothing changed mathematically); at most "
        f"{threshold:g} floors is exact within {precision.word}. "
        f"{power_words(floored).capitalize()}.",
    ])  # fmt: skip
    keys = [*([name_column] if name_column else []), "world_size",
            *(["micro_batches"] if _has_micro_batches(whole) else [])]  # fmt: skip
    header = [*keys, "floor", "floors", f"in {precision.word}"]
    body = [
        [*(str(r[k]) for k in keys), f"{r['floor']:.2g}", f"{r['floors']:.3g}",
         str(r["in_precision"])]
        for _, r in whole.iterrows()
    ]  # fmt: skip
    return [f"In {precision.word} ({precision}):\n{_paragraph(text)}\n\n"
            + runfiles.markdown_table(header, body)]  # fmt: skip


def _closing(table: pd.DataFrame) -> str:
    """The last line of a check whose every W trains like one device: in float64, or as far as
    its own low precision can tell."""
    judged = table["judged_in"].dropna().unique() if "judged_in" in table.columns else []
    own = [p for p in judged if p and p != terms.Precision.FLOAT64]
    if own:
        return (
            "Every world size trains like one device as far as "
            f"{terms.Precision(own[0]).word} can tell (within {FLOOR_THRESHOLD:g} floors)."
        )
    return f"Every world size trains like one device (float64, to {_FLOAT64})."


def explain(checked: CheckResult | pd.DataFrame) -> str:
    """The check as text, what ``python -m gatherlab.check`` prints and the message of
    `gatherlab.testing.assert_layout_invariant`'s ``AssertionError``.

    Args:
        checked: the result of `check_loss` or `check_gather`, or its table alone (the columns
            of `COLUMNS`, and ``train_max_abs_loss_diff`` when present; ``check.csv`` read
            back), which holds no notes.

    Returns:
        The table as Markdown (a loss's parts only where one differs in class from the whole
        gradient), the notes on its one-device reference (`CheckResult.reference_notes`),
        then one paragraph per loss, gather, verdict and cause other than ``exact``, for all the
        world sizes that share it: what was measured or reproduced, the usual causes (labelled as
        not tested) and the fix (docs/design.md §1, docs/checking.md §6). When every verdict is
        exact (or ``loss scaled``), a last line says so. The text ends with a newline.

    Example:
        >>> from gatherlab.check import check_loss, explain
        >>> text = explain(check_loss("gatherlab.losses:NTXentLoss", gather="fixed"))
        >>> text.splitlines()[-1]
        'Every world size trains like one device (float64, to 1e-10).'
        >>> print(explain(check_loss("gatherlab.losses:NTXentLoss", gather="old")))
        | loss | gather | world_size | forward | gradient | verdict | loss_diff | cosine | ...
        ...
        gatherlab.losses:NTXentLoss with gather old, W = 2, 4: biased
          The gradient points in another direction than one device's (cosine 0.980813, 0.928893, ...
        ...
    """
    result = result_of(checked)
    table = result.table
    lines = [markdown(_shown_parts(table))]
    gathers = dict(zip(table["loss"], table["gather"], strict=True))
    lines += _reference_notes(result, "loss", lambda name: name + _via(gathers.get(name, "")))
    whole = table[table["part"] == ALL_PARTS]
    failing = whole[~whole["verdict"].isin((EXACT, *WITHIN))]  # within: the precision's text
    for (loss, gather, verdict_, cause), rows in failing.groupby(
        ["loss", "gather", "verdict", "cause"], sort=False
    ):
        sizes = ", ".join(str(size) for size in rows["world_size"])
        via = _via(gather)
        parts = table[
            (table["loss"] == loss) & (table["gather"] == gather)
            & table["world_size"].isin(rows["world_size"]) & (table["part"] != ALL_PARTS)
        ]  # fmt: skip
        named = f" ({cause})" if cause and verdict_ != terms.LOSS_SCALED else ""
        lines.append(f"{loss}{via}, W = {sizes}: {verdict_}{named}\n"
                     f"{_paragraph(diagnosis(rows, parts))}{_departs(rows)}")  # fmt: skip
    lines += _precision_lines(result, "loss")
    if trains_like_one_device(table):
        lines.append(_closing(table))
    return "\n\n".join(lines) + "\n"


# The columns the check of a training step prints (check.csv has them all).
TRAINING_COLUMNS = (
    "world_size", "micro_batches", "removed", "part", "forward", "gradient", "verdict", "scale",
    "first_diff_step", "train_max_abs_loss_diff", "max_abs_param_diff", "cosine", "norm_ratio",
    "error",
)  # fmt: skip


# The columns of where a run departs: printed below the table, one line per W (check.csv has them).
PLACE = ("where", "departs")

# Columns printed only when a row has something in them.
OPTIONAL = ("part", "scale", "cause", "error")


def markdown(table: pd.DataFrame, columns: Sequence[str] = (*COLUMNS, TRAIN_COLUMN)) -> str:
    """The table as Markdown, in ``columns`` (but ``reference``: the text says when the group
    was needed), the optional ones only when a row fills them."""
    columns = [c for c in columns if c in table.columns and c not in (REFERENCE, *PLACE)]
    if "part" in table.columns and (table["part"] == ALL_PARTS).all():
        columns.remove("part")
    for column in ("scale", "cause", "error"):
        if column in columns and not table[column].map(_filled).any():
            columns.remove(column)
    if "micro_batches" in columns and not _has_micro_batches(table):
        columns.remove("micro_batches")

    def cell(column: str, value: Any) -> str:
        if column == "scale":
            return scale_text(value)
        if value is pd.NA or (isinstance(value, float) and pd.isna(value)):
            return "—"  # a step column with no such step, a failed W's numbers, no cosine
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [[cell(c, row[c]) for c in columns] for _, row in table.iterrows()]
    return runfiles.markdown_table(columns, rows)


def _has_micro_batches(table: pd.DataFrame) -> bool:
    """Whether a training check's layouts have micro-batches (a whole update with K > 1)."""
    return "micro_batches" in table.columns and bool((table["micro_batches"] != 1).any())


def _layouts(rows: pd.DataFrame) -> str:
    """``W = 2, 4`` for the rows' world sizes, or ``(W, K) = (2, 1), (2, 4)`` when their table
    has micro-batches."""
    if "micro_batches" in rows.columns and (rows["micro_batches"] != 1).any():
        pairs = ", ".join(f"({w}, {k})" for w, k in zip(rows["world_size"], rows["micro_batches"],
                                                         strict=True))  # fmt: skip
        return f"(W, K) = {pairs}"
    return "W = " + ", ".join(str(w) for w in dict.fromkeys(rows["world_size"]))


def _departs(rows: pd.DataFrame) -> str:
    """The lines "where it departs, W = 2: <file:line  op>" and below it what differs there, of
    the rows that have a place (`gatherlab.check.where`); "what departs, W = 2:" and what differs,
    of a row with words but no place (no line named, or copies named from the copies alone);
    empty when none has either."""
    lines = [
        (f"\n  where it departs, W = {row['world_size']}: {row['where']}\n" if _filled(row["where"])
         else f"\n  what departs, W = {row['world_size']}:\n")
        + textwrap.indent(textwrap.fill(str(row["departs"]), 96), "    ")
        for _, row in rows.iterrows()
        if "where" in rows.columns and (_filled(row["where"]) or _filled(row.get("departs")))
    ]  # fmt: skip
    return "".join(lines)


def _filled(value: Any) -> bool:
    return not (value is None or value == "" or (isinstance(value, float) and pd.isna(value)))


def _unreduced_words(result: CheckResult, rows: pd.DataFrame) -> dict[str, str]:
    """The words of the cause ``unreduced`` for a training check's rows (their first layout's
    measurement, `CheckResult.unreduced`, `gatherlab.check.training.Unreduced`)."""
    first = rows.iloc[0]
    found = result.unreduced.get((int(first["world_size"]), int(first.get("micro_batches", 1))))
    if found is None:
        return {}
    if found.over:
        return _partial_words(found)
    if found.reduced in TRAINS_LIKE_ONE_DEVICE:
        mean = (f"All-reduced after each backward (the mean over the ranks), the run is "
                f"{found.reduced}: reducing it is the fix.")  # fmt: skip
    elif found.unstalled in TRAINS_LIKE_ONE_DEVICE:
        stalled = ", ".join(found.stalled)
        mean = (f"DDP averaged none of it: its reducer waits, after each backward, for every "
                f"parameter it holds, and {stalled} gets no gradient from DDP's forward (it is "
                f"used outside it, or not at all), so its reduction never completes (with "
                f"{', '.join(found.parts)} all-reduced by hand, the verdict is "
                f"{found.reduced}). With DDP's find_unused_parameters=True and {stalled}'s "
                f"gradient all-reduced, the run is {found.unstalled}: that is the fix, or use "
                f"{stalled} inside the model's forward.")  # fmt: skip
    else:
        mean = (f"All-reduced after each backward, the run is still {found.reduced}: reducing "
                "it alone does not make it one device's.")  # fmt: skip
    return {
        "unreduced_source": "on the ranks",
        "unreduced": ", ".join(found.parts),
        "unreduced_updates": "its first update, every rank's gradient against rank 0's",
        "unreduced_mean": mean,
    }


def _partial_words(found: Any) -> dict[str, str]:
    """The words of the cause ``partial`` (`gatherlab.check.training.Unreduced` of a
    tensor-parallel run: its ``partial`` parameters over ``over``)."""
    if found.reduced in TRAINS_LIKE_ONE_DEVICE:
        reduced = (f"With those sums made whole over {found.over} before each step, the run is "
                   f"{found.reduced}: reproduced.")  # fmt: skip
    else:
        reduced = (f"With those sums made whole before each step, the run is still "
                   f"{found.reduced}: that alone does not make it one device's.")  # fmt: skip
    return {
        "partial": ", ".join(found.partial),
        "partial_over": found.over,
        "partial_stepped_by": f" ({found.stepped_by.split()[-1]} at "
        f"{found.stepped_by.split()[0]} steps the parameters)"
        if found.stepped_by
        else "",
        "partial_reduced": reduced,
    }


def explain_training(checked: CheckResult | pd.DataFrame) -> str:
    """The check of a training step as text: one row per W (its verdict, the culprits found, the
    verdict with all removals made), the table of its runs, then what each culprit means and its
    fix.

    Args:
        checked: the result of `check_training`, or its table alone (``check.csv`` read back),
            which holds no notes.

    Returns:
        The text ``python -m gatherlab.check --module`` prints, ending with a newline; the
        reference's paragraphs as `explain` has them (needed a one-rank group, or differs in one).
    """
    result = result_of(checked)
    table = result.table
    summary = []
    runs = table[table["part"] == ALL_PARTS]
    micro = _has_micro_batches(table)
    keys = ["world_size", "micro_batches"] if micro else ["world_size"]
    causes = runs.loc[runs["removed"] == NONE, "cause"].map(_filled).any()
    for key, rows in runs.groupby(keys, sort=False):
        by_run = rows.set_index("removed")["verdict"]
        culprits = rows["culprits"].iloc[0]
        made = [r for r in (ALL, *Removal) if r in by_run.index]
        after = by_run[made[0]] if made else "—"
        cause = [rows.set_index("removed")["cause"].get(NONE) or "—"] if causes else []
        summary.append([*map(str, key), by_run[NONE], *cause, culprits or "—", after])
    header = [*keys, "verdict", *(["cause"] if causes else []), "culprits",
              "verdict with every removal made"]  # fmt: skip
    lines = [runfiles.markdown_table(header, summary),
             markdown(_shown_parts(table), TRAINING_COLUMNS)]  # fmt: skip
    lines += _reference_notes(result, "training step")
    kept = runs[runs["removed"] == NONE]
    # the verdicts that say more than their culprits: measured, reproduced or split in parts
    named_causes = (terms.Cause.PARTS, terms.Cause.MICRO_NEGATIVES, terms.Cause.UNREDUCED,
                    terms.Cause.PARTIAL, terms.Cause.LOCAL_TOKENS, *_EXPERT_CAUSES,
                    terms.Cause.COPIES_APART, terms.Cause.MICRO_MEAN,
                    terms.Cause.MICRO_SCALE)  # fmt: skip
    said = kept[
        kept["verdict"].isin((terms.DIVERGES, terms.LOSS_SCALED, terms.FAILED))
        | kept["cause"].isin(named_causes)
    ]
    for (verdict_, cause), rows in said.groupby(["verdict", "cause"], sort=False):
        parts = table[table[keys].apply(tuple, axis=1).isin(rows[keys].apply(tuple, axis=1))
                      & (table["part"] != ALL_PARTS)]  # fmt: skip
        named = f" ({cause})" if cause in named_causes else ""
        text = diagnosis(rows, parts, _unreduced_words(result, rows))
        lines.append(f"{_layouts(rows)}: {verdict_}{named}\n{_paragraph(text)}")
    departing = kept[kept["where"].map(_filled)]
    if len(departing):
        lines.append("Where the run without removals departs first:" + _departs(departing))
    found = [c for c in table["culprits"].str.split(";").explode().unique() if c]
    for culprit in found:
        blamed = runs[(runs["removed"] == NONE) & runs["culprits"].str.contains(culprit)]
        lines.append(f"{culprit}, {_layouts(blamed)}:\n{_paragraph(CULPRIT_DIAGNOSES[culprit])}")
    if result.loss_check is not None:
        lines.append("The loss on its own (gatherlab.check on the loss attribute):\n"
                     + explain(result.loss_check).rstrip())  # fmt: skip
    elif Culprit.LOSS in found and result.trained.startswith("--module "):
        # only a module has a loss attribute to name (a plain step or update has none)
        lines.append(
            "  Where the module computes its loss with a module of its own (an "
            "attribute such as\n  self.criterion), name it (--loss-attr) to check the "
            "loss alone."
        )
    lines += _precision_lines(result, None)
    if trains_like_one_device(table):
        own = _closing(table)
        lines.append(own if "as far as" in own else "Every world size trains like one device.")
    return "\n\n".join(lines) + "\n"
