"""torchmultimodal (torchmultimodal-nightly 2024.4.1) BLIP-2 image-text contrastive loss:
``compute_image_text_similarity`` gathers the image and text features with
``BackpropType.NONE`` (``modules/losses/blip2_losses.py:43``, 46): the rank's rows are scored
against every rank's, but no gradient reaches the gathered columns, not even the rank's own:
the gradient is biased. The fix: gather with ``census_fixes.all_gather_rows``, whose backward
sums the gradients (made contiguous) over ranks, then takes the rank's slice: exact. The
release's own flag, ``BackpropType.GLOBAL`` (``torch.distributed.nn``'s all_gather), is measured
too, not as the fix: on gloo its backward is wrong here, because the gradients it receives are
not contiguous (the image features are permuted after the gather) and gloo's scatter, which it
uses, gives a wrong result for them (``torch_gloo_all_gather.py``).

``python experiments/census_repro/blip2_itc.py`` (the two functions, written here: image 2
query tokens of 4, text 4 values, temperature 0.07, label smoothing 0.1);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.torchmultimodal:TmmBlip2Itc``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare
from torch.distributed.nn import all_gather


def no_grad_gather(x):  # BackpropType.NONE
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out)


def torch_gather(x):  # BackpropType.GLOBAL, the release's other flag: measured, not the fix
    return torch.cat(all_gather(x))


def itc(z0, z1, gather=no_grad_gather, temp=0.07):
    image = F.normalize(z0.view(len(z0), 2, 4), dim=-1)
    text = F.normalize(z1[:, :4], dim=-1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    image_all = gather(image) if dist.is_initialized() else image
    text_all = gather(text) if dist.is_initialized() else text
    sim_i2t = (image.unsqueeze(1) @ text_all.unsqueeze(-1)).squeeze().max(-1)[0] / temp
    sim_t2q = text.unsqueeze(1).unsqueeze(1) @ image_all.permute(0, 2, 1)
    sim_t2i = sim_t2q.squeeze().max(-1)[0] / temp
    targets = torch.arange(len(z0)) + rank * len(z0)
    i2t = F.cross_entropy(sim_i2t, targets, label_smoothing=0.1)
    return (i2t + F.cross_entropy(sim_t2i, targets, label_smoothing=0.1)) / 2


def itc_torch_gather(z0, z1):
    return itc(z0, z1, gather=torch_gather)


def itc_fixed(z0, z1):
    return itc(z0, z1, gather=all_gather_rows)


if __name__ == "__main__":
    compare("released: BackpropType.NONE", itc)
    compare("released flag BackpropType.GLOBAL (torch.distributed.nn, on gloo)", itc_torch_gather)
    compare("fixed: census_fixes.all_gather_rows", itc_fixed)
