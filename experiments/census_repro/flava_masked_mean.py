"""torchmultimodal (torchmultimodal-nightly 2024.4.1) FLAVA's ``MaskedPredictionLoss`` (the loss
of MLM, MIM and MMM's text and image parts): the cross-entropy is the mean over the rank's
masked tokens (``modules/losses/flava.py:224``, ``nn.CrossEntropyLoss``'s mean). Every sample's
tokens are masked one by one, so the ranks hold different numbers of masked tokens, and DDP's
average of the ranks' means weights a rank's tokens by one over its own count instead of one
over the global batch's: the loss and its gradient differ from one device's. The fix: the rank's
sum over the masked tokens divided by the mean number of masked tokens per rank (their sum over
ranks, ``census_fixes.all_reduce_sum``, over W): exact.

``python experiments/census_repro/flava_masked_mean.py`` (written here: each sample's 16 values
as 4 tokens of 4, a token masked when its first value of z0 is above 0.3 (at least one per
sample), its label one of 2 words from the sign of z1, a fixed linear head);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.torchmultimodal:TmmFlavaMasked``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_reduce_sum, compare

HEAD = torch.randn(4, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def tokens(z0, z1):
    """The masked tokens' hidden states and labels: a different number per sample."""
    hidden = torch.cat([z0, z1], 1).view(len(z0), 4, 4)
    masked = z0.detach().view(len(z0), 4, 2)[..., 0] > 0.3
    masked[:, 0] |= ~masked.any(1)
    labels = (z1.detach().view(len(z0), 4, 2)[..., 0] > 0).long()
    return hidden[masked] @ HEAD, labels[masked]


def masked_mean(z0, z1):  # released: the mean over the rank's masked tokens
    logits, labels = tokens(z0, z1)
    return F.cross_entropy(logits, labels)


def masked_mean_fixed(z0, z1):  # the rank's sum over the mean count of masked tokens per rank
    logits, labels = tokens(z0, z1)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    count = all_reduce_sum(torch.tensor(float(len(labels)), dtype=torch.float64))
    return F.cross_entropy(logits, labels, reduction="sum") * world_size / count


if __name__ == "__main__":
    compare("released: the mean over the rank's masked tokens", masked_mean)
    compare("fixed: the sum over the mean number of masked tokens per rank", masked_mean_fixed)
