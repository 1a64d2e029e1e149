"""open-clip-torch 3.3.0 ``CoCaLoss``: its caption loss is ``nn.CrossEntropyLoss(ignore_index=
pad_id)`` of the rank's tokens (``open_clip/loss.py:191``), a mean over the rank's non-pad
tokens. When ranks hold different numbers of pad tokens (captions of different lengths), the
mean over ranks of these means is not the mean over all tokens that one device takes, whatever
the contrastive flags (``gather_with_grad=True`` makes that part exact). The fix: sum over the
rank's tokens, divide by the non-pad tokens of all ranks (all_reduce), times W.

``python experiments/census_repro/coca_caption.py`` (the caption part, written here: 4 tokens of
4 classes from z1, labels from z0's signs, class 0 the pad); ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.open_clip:CoCaForCheck --kwargs '{"gather_with_grad": true}'``.
"""

import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare


def caption(z0, z1, fixed=False, pad=0):
    signs = (z0.detach()[:, :8] > 0).long().view(-1, 4, 2)
    labels = 2 * signs[..., 0] + signs[..., 1]
    logits = z1.view(-1, 4, 4).permute(0, 2, 1)
    if not (fixed and dist.is_initialized()):  # the release: the mean over the rank's tokens
        return F.cross_entropy(logits, labels, ignore_index=pad)
    tokens = (labels != pad).sum().to(z1.dtype)
    dist.all_reduce(tokens)
    total = F.cross_entropy(logits, labels, ignore_index=pad, reduction="sum")
    return total * dist.get_world_size() / tokens


def caption_fixed(z0, z1):
    return caption(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: the mean over the rank's non-pad tokens", caption, dim=16)
    compare("fixed: over all ranks' non-pad tokens", caption_fixed, dim=16)
