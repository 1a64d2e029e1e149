"""torchmultimodal (torchmultimodal-nightly 2024.4.1) FLAVA's ``FLAVAGlobalContrastiveLoss`` as
``FLAVAPretrainingLoss`` calls it with ITM labels: only the matching pairs' rows are kept
(``modules/losses/contrastive_loss_with_temperature.py:98``, the mask), and the cross-entropy
is their mean on the rank (line 105). The features are gathered with a gradient that sums
(``BackpropType.GLOBAL``), but the ranks keep different numbers of rows, and DDP's average of
the ranks' means weights a rank's rows by one over its own count instead of one over the global
batch's: the loss and its gradient differ from one device's. The fix: the rank's sum over its
kept rows divided by the mean number of kept rows per rank (their sum over ranks,
``census_fixes.all_reduce_sum``, over W): exact.

``python experiments/census_repro/flava_contrastive_mask.py`` (written here: both views
normalised, gathered with ``all_gather_rows`` as the released GLOBAL gather sums, logit scale
1/0.07, a row kept when its third value of z0 is positive); ``PYTHONPATH=experiments python
-m gatherlab.check census_cases.torchmultimodal:TmmFlavaContrastiveMasked`` (with the case's
``inputs``).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, all_reduce_sum, compare


def logits_and_targets(z0, z1):
    image, text = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    image_all, text_all = all_gather_rows(image), all_gather_rows(text)
    targets = torch.arange(len(z0)) + rank * len(z0)
    keep = z0.detach()[:, 2] > 0  # the matching pairs: about half
    logits_a = image @ text_all.T / 0.07
    logits_b = text @ image_all.T / 0.07
    return logits_a[keep], logits_b[keep], targets[keep]


def masked(z0, z1):  # released: the mean over the rank's kept rows
    logits_a, logits_b, targets = logits_and_targets(z0, z1)
    return (F.cross_entropy(logits_a, targets) + F.cross_entropy(logits_b, targets)) / 2


def masked_fixed(z0, z1):  # the rank's sum over the mean number of kept rows per rank
    logits_a, logits_b, targets = logits_and_targets(z0, z1)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    kept = all_reduce_sum(torch.tensor(float(len(targets)), dtype=torch.float64)) / world_size
    summed = F.cross_entropy(logits_a, targets, reduction="sum")
    return (summed + F.cross_entropy(logits_b, targets, reduction="sum")) / kept / 2


if __name__ == "__main__":
    compare("released: the mean over the rank's kept rows", masked)
    compare("fixed: the sum over the mean number of kept rows per rank", masked_fixed)
