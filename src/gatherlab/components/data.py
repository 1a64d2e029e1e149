"""Data sets of view pairs and the samplers that make every layout see the same global batches.

The sampler follows docs/design.md §2: one permutation per epoch drawn from (seed, epoch) alone,
global batch k is the k-th contiguous block of it, and rank r takes the r-th contiguous slice of
that block. Gathering the ranks' batches in rank order therefore rebuilds the single-device batch
row for row, whatever the number of ranks. The sampler hands each data set a key ``(epoch, index)``
per sample, so that a data set with random augmentations can draw them from (seed, epoch, index)
(``digits``). `LayoutInvariantSampler` is the same rule for a user's own job, a drop-in for
``DistributedSampler`` (public as ``gatherlab.data``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Sampler

from gatherlab.components.augment import VIEW_STREAMS, Augmentation, sample_generator
from gatherlab.core import terms
from gatherlab.ranks import world

SEEDINGS = ("per_sample", "per_process")


class PairDataset(Dataset):
    """Pairs ``(view0[i], view1[i])`` held in memory.

    ``encode_second_view`` tells the trainer whether view 1 goes through the model too (two
    augmented views) or is a fixed target embedding (the case of lightly PR #1531's test).
    """

    def __init__(self, view0: torch.Tensor, view1: torch.Tensor, encode_second_view: bool = True):
        if len(view0) != len(view1):
            raise ValueError(f"views have {len(view0)} and {len(view1)} samples")
        self.view0, self.view1 = view0, view1
        self.encode_second_view = encode_second_view

    def __len__(self) -> int:
        return len(self.view0)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = key[1] if isinstance(key, tuple) else key  # (epoch, index): no randomness here
        return self.view0[index], self.view1[index]


def arange_pairs() -> PairDataset:
    """lightly PR #1531's test: inputs arange(80) as (8, 2, 5), targets arange(32) as (8, 2, 2)."""
    inputs = torch.arange(80, dtype=torch.float64).reshape(8, 2, 5)
    targets = torch.arange(32, dtype=torch.float64).reshape(8, 2, 2)
    return PairDataset(inputs, targets, encode_second_view=False)


def gaussian_pairs(num_samples: int, dim: int, noise: float = 0.5, seed: int = 0) -> PairDataset:
    """Views x + noise·ε₀ and x + noise·ε₁ of standard normal points x, all drawn from ``seed``."""
    if num_samples < 1 or dim < 1:
        raise ValueError(
            f"data.num_samples and data.dim must be positive, got {num_samples}, {dim}"
        )
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    view0 = points + noise * torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    view1 = points + noise * torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    return PairDataset(view0, view1)


def token_pairs(
    num_samples: int, length: int, vocab_size: int, seed: int = 0, sharpness: float = 3.0
) -> PairDataset:
    """Sequences of ``length + 1`` token ids from a Markov chain drawn from ``seed`` (each token's
    next-token distribution the softmax of standard normal logits times ``sharpness``: peaked, so a
    language model has something to learn), as pairs (the first ``length`` tokens, the next token
    at each position): the inputs and targets of a causal language model (``model=tiny_lm``; the
    second view is the target, not encoded)."""
    if num_samples < 1 or length < 1 or vocab_size < 2:
        raise ValueError(
            f"data.num_samples={num_samples}, data.length={length}, data.vocab_size={vocab_size}; "
            "allowed: positive counts and a vocabulary of at least 2 tokens"
        )
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(
        vocab_size, vocab_size, generator=generator, dtype=torch.float64
    )
    transitions = torch.softmax(logits, dim=1)
    tokens = torch.empty(num_samples, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (num_samples,), generator=generator)
    for position in range(length):
        tokens[:, position + 1] = torch.multinomial(
            transitions[tokens[:, position]], 1, generator=generator
        ).squeeze(1)
    return PairDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone(), encode_second_view=False)


class DigitsPairs(Dataset):
    """Two augmented views of each image of scikit-learn's 8×8 handwritten digits (1,797 images,
    shipped with the package), pixel values scaled to [0, 1].

    The images are split into train and test once, by ``split_seed``; training draws from the
    train split. ``seeding="per_sample"`` draws every augmentation from (seed, epoch, sample
    index, view), the same on any layout; ``"per_process"`` is what a plain DDP run does, one RNG
    per process seeded by (seed, rank), so the views depend on how the batch is split (an
    ablation). Each item is ``(view0, view1, key)`` with ``key = [epoch, index]``, which the
    model's seeded dropout uses.
    """

    encode_second_view = True

    def __init__(
        self,
        seed: int = 0,
        split_seed: int = 0,
        test_size: int = 360,
        seeding: str = "per_sample",
        augmentation: Augmentation | None = None,
    ):
        from sklearn.datasets import load_digits

        if seeding not in SEEDINGS:
            raise ValueError(f"data.seeding={seeding!r} is unknown; allowed: {', '.join(SEEDINGS)}")
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float64)[:, None] / 16.0
        labels = torch.tensor(digits.target)
        if not 0 < test_size < len(images):
            raise ValueError(f"data.test_size={test_size} must be in 1..{len(images) - 1}")
        order = torch.as_tensor(np.random.default_rng(split_seed).permutation(len(images)))
        test, train = order[:test_size], order[test_size:]
        self.images, self.labels = images[train], labels[train]
        self.test_images, self.test_labels = images[test], labels[test]
        self.seed, self.seeding, self.split_seed = seed, seeding, split_seed
        self.augmentation = augmentation or Augmentation()
        self._process_generator: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.images)

    def _generators(self, epoch: int, index: int) -> tuple[torch.Generator, torch.Generator]:
        if self.seeding == "per_sample":
            return tuple(sample_generator(self.seed, epoch, index, s) for s in VIEW_STREAMS)
        if self._process_generator is None:
            rank_seed = np.random.SeedSequence([self.seed, world.rank()]).generate_state(1)
            self._process_generator = torch.Generator().manual_seed(int(rank_seed[0]))
        return self._process_generator, self._process_generator

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        epoch, index = key
        image = self.images[index]
        generator0, generator1 = self._generators(epoch, index)
        view0 = self.augmentation(image, generator0)
        view1 = self.augmentation(image, generator1)
        return view0, view1, torch.tensor([epoch, index])

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, neighbours: int = 5) -> dict[str, float]:
        """Test accuracy of a k-NN classifier (cosine similarity, majority of ``neighbours``,
        ties to the nearest) on the frozen features ``model.features`` of the un-augmented
        images, the train split as its memory."""
        model.eval()
        dtype = next(model.parameters()).dtype
        memory = F.normalize(model.features(self.images.to(dtype)), dim=1)
        queries = F.normalize(model.features(self.test_images.to(dtype)), dim=1)
        nearest = (queries @ memory.T).topk(neighbours, dim=1).indices
        votes = self.labels[nearest]
        counts = F.one_hot(votes, num_classes=10).sum(dim=1).to(torch.float64)
        # the nearest neighbour's label breaks ties: it gets a fraction of a vote extra
        counts += 0.5 * F.one_hot(votes[:, 0], num_classes=10)
        predicted = counts.argmax(dim=1)
        return {
            "knn_accuracy": float((predicted == self.test_labels).double().mean()),
            "few_shot_accuracy": self.few_shot_accuracy(model.features, dtype),
        }

    @torch.no_grad()
    def few_shot_accuracy(
        self, features=None, dtype: torch.dtype = torch.float64, shots: int = 1, draws: int = 50
    ) -> float:
        """Test accuracy of a nearest-class-mean classifier (cosine) that knows ``shots`` labelled
        train images per class, averaged over ``draws`` draws of those images (the same draws for
        every model: seeded by ``split_seed``). Unlike the k-NN with the whole train split as its
        memory, it is far from saturated on raw pixels and on an untrained network. ``features``:
        the frozen feature map (None: the raw pixels)."""
        encode = features or (lambda images: images.flatten(1))
        train = F.normalize(encode(self.images.to(dtype)), dim=1)
        test = F.normalize(encode(self.test_images.to(dtype)), dim=1)
        rng = np.random.default_rng(self.split_seed)
        correct = []
        for _ in range(draws):
            chosen = [
                rng.choice(np.flatnonzero(self.labels.numpy() == label), shots, replace=False)
                for label in range(10)
            ]
            means = torch.stack([train[torch.as_tensor(rows)].mean(dim=0) for rows in chosen])
            predicted = (test @ F.normalize(means, dim=1).T).argmax(dim=1)
            correct.append(float((predicted == self.test_labels).double().mean()))
        return float(np.mean(correct))


def digits_pairs(
    seed: int = 0, split_seed: int = 0, test_size: int = 360, seeding: str = "per_sample", **aug
) -> DigitsPairs:
    """The ``digits`` data set of the configs (augmentation settings as keyword arguments)."""
    return DigitsPairs(seed, split_seed, test_size, seeding, Augmentation(**aug))


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The sample order of ``epoch``: a permutation drawn from (seed, epoch) alone, or 0..n-1."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng((seed, epoch)).permutation(num_samples)


class GlobalBatchSampler:
    """Yields, for ``num_batches`` optimizer steps, this rank's slice of each global batch."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        num_batches: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        with_epoch: bool = False,
    ):
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by {world_size} devices"
            )
        if global_batch_size > num_samples:
            raise ValueError(
                f"global_batch_size={global_batch_size} exceeds the {num_samples} samples"
            )
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.num_batches, self.rank, self.world_size = num_batches, rank, world_size
        self.seed, self.shuffle, self.with_epoch = seed, shuffle, with_epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int] | list[tuple[int, int]]]:
        """Each step's indices, or ``(epoch, index)`` keys ``with_epoch``."""
        batches_per_epoch = self.num_samples // self.global_batch_size
        own = terms.rows_of(self.rank, self.world_size, self.global_batch_size)
        order = None
        for step in range(self.num_batches):
            epoch, block = divmod(step, batches_per_epoch)
            if block == 0:
                order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
            start = block * self.global_batch_size
            indices = order[start + own.start : start + own.stop].tolist()
            yield [(epoch, index) for index in indices] if self.with_epoch else indices


class LayoutInvariantSampler(Sampler[int]):
    """A drop-in for ``torch.utils.data.DistributedSampler`` that gives every world size the same
    global batch at every update (docs/design.md §2, "DistributedSampler and the layout-invariant
    sampler").

    Each epoch's order is DistributedSampler's own permutation, ``torch.randperm(n,
    generator=torch.Generator().manual_seed(seed + epoch))`` (0..n-1 without ``shuffle``), cut into
    global batches of ``global_batch_size`` consecutive indices; rank r yields the r-th contiguous
    slice of each, ``global_batch_size / num_replicas`` indices. A ``DataLoader`` with that
    ``batch_size`` on every rank therefore loads, rank after rank, the one-device run's batch in its
    order. ``drop_last=True`` skips the last, incomplete global batch; ``False`` completes it with
    the epoch's first indices (as DistributedSampler pads), so it is the same on every world size
    too. ``num_replicas`` and ``rank`` default to the process group's when one is initialised, else
    to one device (1 and 0). Call ``set_epoch(epoch)`` before each epoch, as with
    DistributedSampler.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
        if num_replicas is None:
            num_replicas = torch.distributed.get_world_size() if grouped else 1
        if rank is None:
            rank = torch.distributed.get_rank() if grouped else 0
        if not terms.is_integer(num_replicas, 1):
            raise ValueError(
                f"num_replicas={num_replicas!r} is not allowed; allowed: {terms.allowed_integer(1)}"
            )
        if not (terms.is_integer(rank, 0) and rank < num_replicas):
            raise ValueError(
                f"rank={rank!r} is not allowed; allowed: an integer in 0..{num_replicas - 1}"
            )
        if not terms.is_integer(global_batch_size, 1) or global_batch_size % num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size!r} does not divide by "
                f"num_replicas={num_replicas}; allowed: a positive multiple of {num_replicas}"
            )
        if drop_last and global_batch_size > len(dataset):
            raise ValueError(
                f"global_batch_size={global_batch_size} exceeds the data set's {len(dataset)} "
                f"samples with drop_last=True; allowed: at most {len(dataset)}, or drop_last=False"
            )
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next iteration yields (seed + epoch)."""
        self.epoch = epoch

    @property
    def num_batches(self) -> int:
        """Global batches per epoch: the complete ones, or all of them without ``drop_last``."""
        whole, left = divmod(len(self.dataset), self.global_batch_size)
        return whole + (1 if left and not self.drop_last else 0)

    def __len__(self) -> int:
        """The indices this rank yields per epoch."""
        return self.num_batches * (self.global_batch_size // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        total = self.num_batches * self.global_batch_size
        if total > n:  # the last global batch completed with the epoch's first indices
            order = torch.cat([order] * (total // n + 1))
        own = terms.rows_of(self.rank, self.num_replicas, self.global_batch_size)
        for start in range(0, total, self.global_batch_size):
            yield from order[start + own.start : start + own.stop].tolist()
