"""sentence-transformers 6.2.0 ``GISTEmbedLoss(gather_across_devices=True)`` (and
``CachedGISTEmbedLoss``, the same terms over mini-batches of anchors): the positives and the
guide's positive embeddings are gathered from every rank (``gist_embed.py:180``), so the
anchor-positive and positive-positive scores of a rank's rows are one device's rows; but the
anchor-anchor term (``contrast_anchors``, on by default) scores the rank's anchors against its
own anchors only (``gist_embed.py:223``, ``self.sim_matrix(anchor, anchor)``): every other
rank's anchors are missing from the softmax's denominator. The loss and its gradient differ
from one device's. With ``contrast_anchors=False`` the rest is exact. The fix: score the
anchors against every rank's anchors (and the guide's likewise), gathered with
``all_gather_with_grad`` as the positives are.

``python experiments/census_repro/sbert_gist.py`` (the guide here is a fixed random projection of
the embeddings, without gradient, in place of a second model; the false-negative masking as
released: a candidate the guide finds closer to the anchor than its positive is left out);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.sentence_transformers:SbertGIST
--inputs census_cases.sentence_transformers:gist_texts --kwargs '{"gather_across_devices":
true}'`` (once the census has unpacked the release).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare

TEMPERATURE = 0.05
GUIDE = torch.randn(8, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def similarities(a, b):
    return F.cosine_similarity(a[:, None], b[None], dim=-1)


def gist(z0, z1, fixed=False, contrast_anchors=True):
    guide0, guide1 = z0.detach() @ GUIDE, z1.detach() @ GUIDE  # the guide: no gradient
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rows, offset = len(z0), (dist.get_rank() if world_size > 1 else 0) * len(z0)
    anchors, anchors_guide = z0, guide0
    positives, positives_guide = z1, guide1
    if world_size > 1:  # the candidates gathered, whose backward sums the ranks' gradients
        positives, positives_guide = all_gather_rows(z1), all_gather_rows(guide1)
        if fixed:
            anchors, anchors_guide = all_gather_rows(z0), all_gather_rows(guide0)
    own = torch.arange(rows)
    guided_ap = similarities(guide0, positives_guide)
    threshold = guided_ap[own, offset + own][:, None]

    def masked(scores, guided, keep=None):
        mask = guided > threshold  # closer to the anchor than its positive, by the guide
        if keep is not None:
            mask &= ~keep
        return scores.masked_fill(mask, -torch.inf)

    keep = torch.zeros_like(guided_ap, dtype=torch.bool)
    keep[own, offset + own] = True
    scores = [masked(similarities(z0, positives), guided_ap, keep)]
    if contrast_anchors:
        scores.append(masked(similarities(z0, anchors), similarities(guide0, anchors_guide)))
    mine = slice(offset, offset + rows)  # the rank's own positives, among the gathered
    scores.append(masked(similarities(positives[mine], positives),
                         similarities(positives_guide[mine], positives_guide)))  # fmt: skip
    logits = torch.cat(scores, 1) / TEMPERATURE
    return F.cross_entropy(logits, offset + own)


def gist_fixed(z0, z1):
    return gist(z0, z1, fixed=True)


def gist_no_anchor_term(z0, z1):
    return gist(z0, z1, contrast_anchors=False)


if __name__ == "__main__":
    compare("released: the anchor-anchor term over the rank's own anchors", gist)
    compare("released, contrast_anchors=False", gist_no_anchor_term)
    compare("fixed: the anchor-anchor term over every rank's anchors", gist_fixed)
