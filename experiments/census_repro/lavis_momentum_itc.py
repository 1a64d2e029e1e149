"""LAVIS (salesforce-lavis 1.0.2) ALBEF's and BLIP's image-text contrastive loss
(``AlbefPretrain.forward``, ``BlipPretrain.forward``): each rank's image and text features are
scored against the momentum features of the rank's own batch followed by a queue
(``lavis/models/albef_models/albef_pretrain.py:172``, 183; ``blip_pretrain.py:212``, 219), with
the targets on the diagonal of the rank's batch. The queue holds every rank's momentum features
(``_dequeue_and_enqueue`` gathers them), but the batch's own columns are the rank's only: a rank
sees B/W in-batch negatives where one device sees B, and the loss and its gradient differ from
one device's. The fix: the batch's momentum features gathered from every rank (they carry no
gradient: ``concat_all_gather``) and the targets on the rank's columns of them: exact.

``python experiments/census_repro/lavis_momentum_itc.py`` (written here: the momentum features
the detached features themselves, a fixed queue of 32 random unit columns, temperature 0.07,
soft targets with alpha 0.4; one step, so the queue is not updated);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.lavis:LavisMomentumItc --steps 3``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare

QUEUE = F.normalize(torch.randn(8, 32, generator=torch.Generator().manual_seed(1),
                                dtype=torch.float64), dim=0)  # fmt: skip


def itc(z0, z1, gathered=False, temp=0.07, alpha=0.4):
    image, text = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
    image_m, text_m = image.detach(), text.detach()  # the momentum features, no gradient
    rank = dist.get_rank() if dist.is_initialized() else 0
    if gathered and dist.is_initialized():  # fixed: every rank's momentum features
        batch_image, batch_text = all_gather_rows(image_m), all_gather_rows(text_m)
    else:  # released: the rank's own
        batch_image, batch_text, rank = image_m, text_m, 0
    image_all = torch.cat([batch_image.t(), QUEUE], dim=1)
    text_all = torch.cat([batch_text.t(), QUEUE], dim=1)
    with torch.no_grad():
        targets = torch.zeros(len(z0), image_all.shape[1], dtype=torch.float64)
        targets[:, rank * len(z0) : (rank + 1) * len(z0)].fill_diagonal_(1)
        i2t_targets = alpha * F.softmax(image_m @ text_all / temp, 1) + (1 - alpha) * targets
        t2i_targets = alpha * F.softmax(text_m @ image_all / temp, 1) + (1 - alpha) * targets
    i2t = -(F.log_softmax(image @ text_all / temp, 1) * i2t_targets).sum(1).mean()
    t2i = -(F.log_softmax(text @ image_all / temp, 1) * t2i_targets).sum(1).mean()
    return (i2t + t2i) / 2


def itc_fixed(z0, z1):
    return itc(z0, z1, gathered=True)


if __name__ == "__main__":
    compare("released: the rank's own momentum features, then the queue", itc)
    compare("fixed: every rank's momentum features (no gradient), then the queue", itc_fixed)
