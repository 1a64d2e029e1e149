"""x-clip 0.14.4 ``x_clip/distributed.py``: ``all_gather`` (``AllGather``, which ``CLIP.forward``
applies to the text and image latents whenever a group of more than one rank exists) cannot
run: the file uses ``exists`` and ``F`` and defines neither (``NameError: name 'exists' is not
defined`` at its first call, on every rank). With both defined, its backward keeps only the own
slice of the gradient (``grads_by_rank[rank]``, distributed.py:54) while every rank computes the
whole contrastive loss: the gradient is 1/W of one device's. The fix: define them, and sum every
rank's gradient (all_reduce) before taking the own slice.

``python experiments/census_repro/x_clip_all_gather.py`` (a CLIP loss over the gathered
latents, written here, on the two gathers); ``PYTHONPATH=experiments python -m gatherlab.check
gatherlab.losses:NTXentGlobalLoss --gather census_cases.x_clip:x_clip_gather --kwargs
'{"temperature": 0.5}'`` checks the released gather itself.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare


class OwnSlice(torch.autograd.Function):  # AllGather with F and exists defined
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grads):
        return grads.split(len(grads) // dist.get_world_size())[dist.get_rank()]


class Summed(OwnSlice):  # the fix
    @staticmethod
    def backward(ctx, grads):
        grads = grads.contiguous()
        dist.all_reduce(grads)
        return grads.split(len(grads) // dist.get_world_size())[dist.get_rank()]


def clip(text, image, gather=OwnSlice, temperature=0.5):
    text, image = F.normalize(text, dim=1), F.normalize(image, dim=1)
    if dist.is_initialized() and dist.get_world_size() > 1:  # CLIP.forward's condition
        text, image = gather.apply(torch.stack((text, image), 1)).unbind(1)
    sim = text @ image.T / temperature
    labels = torch.arange(len(sim))
    return 0.5 * (F.cross_entropy(sim, labels) + F.cross_entropy(sim.T, labels))


def clip_fixed(text, image):
    return clip(text, image, gather=Summed)


if __name__ == "__main__":
    compare("released (F and exists defined): own slice of the gradient", clip)
    compare("fixed: every rank's gradient summed", clip_fixed)
