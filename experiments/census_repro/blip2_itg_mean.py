"""torchmultimodal (torchmultimodal-nightly 2024.4.1) BLIP-2's captioning loss ``itg_loss``: the
cross-entropy (label smoothing 0.1) is the mean over the rank's tokens that are not padding
(``modules/losses/blip2_losses.py:128``, ``reduction="mean"`` with the padding's label -100).
Captions differ in length, so the ranks hold different numbers of tokens, and DDP's average of
the ranks' means weights a rank's tokens by one over its own count instead of one over the
global batch's: the loss and its gradient differ from one device's. The fix: the rank's sum over
its tokens divided by the mean number of tokens per rank (their sum over ranks,
``census_fixes.all_reduce_sum``, over W): exact.

``python experiments/census_repro/blip2_itg_mean.py`` (written here: each sample's 16 values as
4 tokens of 4 scored by a fixed linear head over a vocabulary of 3, a caption of 2 to 4 tokens
whose length and words are read from z1, the first token's label dropped as the shift does);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.torchmultimodal:TmmBlip2Itg``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_reduce_sum, compare

HEAD = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def scores_and_labels(z0, z1):
    """Each token's scores and its next word's label, -100 past the caption's end."""
    scores = torch.cat([z0, z1], 1).view(len(z0), 4, 4) @ HEAD
    length = 2 + (z1.detach()[:, 0] > 0).long() + (z1.detach()[:, 1] > 0).long()
    words = (z1.detach()[:, 2:6] > 0).long() + 1
    labels = words.masked_fill(torch.arange(4) >= length[:, None], -100)
    return scores[:, :-1].reshape(-1, 3), labels[:, 1:].reshape(-1)


def itg(z0, z1):  # released: the mean over the rank's tokens
    scores, labels = scores_and_labels(z0, z1)
    return F.cross_entropy(scores, labels, label_smoothing=0.1)


def itg_fixed(z0, z1):  # the rank's sum over the mean number of tokens per rank
    scores, labels = scores_and_labels(z0, z1)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    count = all_reduce_sum(labels.ne(-100).sum().to(torch.float64))
    summed = F.cross_entropy(scores, labels, reduction="sum", label_smoothing=0.1)
    return summed * world_size / count


if __name__ == "__main__":
    compare("released: the mean over the rank's tokens", itg)
    compare("fixed: the sum over the mean number of tokens per rank", itg_fixed)
