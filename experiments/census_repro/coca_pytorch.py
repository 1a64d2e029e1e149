"""CoCa-pytorch 0.1.0 ``CoCa.forward(..., return_loss=True)`` on more than one rank: the latents
are gathered (``all_gather``), so the similarity matrix is N × N, but the contrastive labels are
``torch.arange(batch)`` with ``batch`` the rank's batch size (``coca_pytorch.py:532``):
``ValueError: Expected input batch_size (16) to match target batch_size (8)`` on every rank.
With the labels of every gathered row, ``AllGather.backward`` keeps only the own slice of the
gradient (coca_pytorch.py:61) while every rank computes the whole contrastive loss: its
gradient is 1/W of one device's, beside a caption loss that is exact. The fix: ``arange`` over
the gathered rows and the gradient summed over ranks (all_reduce) before the own slice.

``python experiments/census_repro/coca_pytorch.py`` (the contrastive part, written here);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.coca_pytorch:CocaPytorch`` runs the
released model's loss.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare
from x_clip_all_gather import OwnSlice, Summed


def contrastive(text, image, gather=OwnSlice, labels_of_everyone=False):
    batch = len(text)  # coca_pytorch.py: batch, device = text.shape[0], text.device
    if dist.is_initialized() and dist.get_world_size() > 1:
        text, image = gather.apply(torch.stack((text, image), 1)).unbind(1)
    sim = text @ image.T
    labels = torch.arange(len(sim) if labels_of_everyone else batch)
    return 0.5 * (F.cross_entropy(sim, labels) + F.cross_entropy(sim.T, labels))


def labels_fixed(text, image):
    return contrastive(text, image, labels_of_everyone=True)


def both_fixed(text, image):
    return contrastive(text, image, gather=Summed, labels_of_everyone=True)


if __name__ == "__main__":
    try:
        compare("released: labels of the rank's batch", contrastive, world_sizes=(2,))
    except Exception as error:  # the spawned rank's ValueError, as the check reports it
        print(f"  W = 2: {str(error).strip().splitlines()[-1]}")
    compare("the labels fixed: own slice of the gradient", labels_fixed)
    compare("both fixed", both_fixed)
