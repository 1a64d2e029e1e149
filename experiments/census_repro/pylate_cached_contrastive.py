"""pylate 1.6.0 ``CachedContrastive(gather_across_devices=True)`` on the path training takes: its
forward and the backward of the loss it returns (GradCache). The forward embeds every chunk of
rows without gradient, scores the rank's queries against every rank's documents (gathered with
``torch.distributed.nn``'s ``all_gather``, ``utils/distributed.py:91``, whose backward sums every
rank's gradient of each slice), multiplies each query chunk's summed cross-entropy by W
(``losses/cached_contrastive.py:317``), backpropagates it to the embeddings at once (line 322)
and caches their gradients; it returns the sum over the rank's batch (line 328), detached, with a
hook that embeds every chunk again and backpropagates its cached gradient (line 75). The returned
loss is W times one device's; the gradient is one device's: the W that multiplies the cached
gradients is the one DDP's average divides by. Without the ×W (the former patch) the gradient is
1/W of one device's; the fix divides the returned value alone by W.

Not about W: the gradient is that of the summed cross-entropy, B times (B the global batch) the
gradient of the mean the loss returns; the last line printed measures it on one device.

``python experiments/census_repro/pylate_cached_contrastive.py`` (MaxSim over 2 tokens of 4
dimensions, chunks of 4 rows, written here; the "model" is each token's normalisation, embedded
again in the replay); ``PYTHONPATH=experiments python -m gatherlab.check
census_cases.pylate:PylateCachedContrastive --kwargs '{"gather_across_devices": true}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare

CHUNK = 4  # the rows embedded, and the query rows scored, at a time


def embed(rows):
    """The model: each row's 8 dimensions as 2 tokens of 4, each token normalised."""
    return F.normalize(rows.view(len(rows), 2, 4), dim=-1)


def maxsim(queries, documents):
    """Each query against each document: the sum over its tokens of the best token match."""
    return torch.einsum("qtd,psd->qpts", queries, documents).amax(dim=-1).sum(dim=-1)


def cached_contrastive(z0, z1, times_w=True, value_over_w=False):
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with torch.no_grad():  # (1) every chunk embedded without a graph
        chunks = [embed(rows).requires_grad_() for z in (z0, z1) for rows in z.split(CHUNK)]
    half = len(chunks) // 2  # view 0's chunks, the queries, then view 1's, the documents
    queries, documents = torch.cat(chunks[:half]), torch.cat(chunks[half:])
    if world_size > 1:  # a gather whose backward sums the gradients, as torch.distributed.nn's
        documents = all_gather_rows(documents)
    labels = torch.arange(len(queries)) + rank * len(queries)
    total = 0.0
    for begin in range(0, len(queries), CHUNK):  # (2) each chunk's loss backpropagated at once
        part = slice(begin, begin + CHUNK)
        chunk = F.cross_entropy(maxsim(queries[part], documents), labels[part], reduction="sum")
        chunk = chunk * world_size if times_w else chunk
        chunk.backward(retain_graph=True)
        total += chunk.item()
    cached = [embedded.grad for embedded in chunks]
    value = total / len(queries) / (world_size if value_over_w else 1)
    returned = torch.tensor(value, dtype=z0.dtype, requires_grad=True)

    def replay(grad):  # (3) each chunk embedded again, its cached gradient backpropagated
        with torch.enable_grad():  # a backward hook runs without a graph
            rows = [*z0.split(CHUNK), *z1.split(CHUNK)]
            for again, gradient in zip(rows, cached, strict=True):
                ((embed(again) * gradient).sum() * grad).backward()

    returned.register_hook(replay)
    return returned


def former_patch(z0, z1):
    return cached_contrastive(z0, z1, times_w=False)


def value_fixed(z0, z1):
    return cached_contrastive(z0, z1, value_over_w=True)


def batch_factor(rows=16, dim=8, seed=0):
    """On one device: the gradient training gets against the gradient of the mean returned."""
    generator = torch.Generator().manual_seed(seed)
    z0 = torch.randn(rows, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    z1 = z0.detach() + 0.5 * torch.randn(rows, dim, generator=generator, dtype=torch.float64)
    z1.requires_grad_()
    cached_contrastive(z0, z1).backward()
    trained = torch.cat([z0.grad, z1.grad])
    z0.grad = z1.grad = None
    mean = F.cross_entropy(maxsim(embed(z0), embed(z1)), torch.arange(rows))
    mean.backward()
    returned = torch.cat([z0.grad, z1.grad])
    cosine = F.cosine_similarity(trained.flatten(), returned.flatten(), 0)
    print(f"one device, B = {rows}: the gradient trained is {trained.norm() / returned.norm():.4g}"
          f" times that of the mean returned (cosine {cosine:.4g})")  # fmt: skip


if __name__ == "__main__":
    compare("released: the loss W times one device's, the gradient one device's",
            cached_contrastive, world_sizes=(2, 4, 8))  # fmt: skip
    compare("the former patch, no ×W: the gradient 1/W", former_patch, world_sizes=(2, 4, 8))
    compare("fixed: the returned value divided by W", value_fixed, world_sizes=(2, 4, 8))
    batch_factor()
