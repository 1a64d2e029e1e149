"""A Hugging Face ``Trainer`` job, recorded with one line (``callbacks=[HFRecorder(DIR)]``).

A small classifier (an ``nn.Module`` whose forward returns ``{"loss", "logits"}``, which the
``Trainer`` accepts as it accepts a ``PreTrainedModel``) trained on a fixed synthetic data set, in
float64 on the CPU, with the Trainer's own sampler, gradient clipping and optimizer. The global
batch is the same at every world size: each rank takes ``--global-batch-size / (W × K)`` rows per
forward, K = ``--accumulation``. Run it on one process or under torchrun (gloo)::

    python examples/jobs/hf_job.py --record runs/hf_w1
    python -m torch.distributed.run --nproc-per-node 2 examples/jobs/hf_job.py --record runs/hf_w2
    python -m gatherlab.compare runs/hf_w1 runs/hf_w2

The two recordings agree to rounding: accelerate gives rank r the r-th of every W consecutive
per-rank batches of one seeded sampler, which together are one device's batch, and DDP averages
the ranks' gradients of their mean losses, which is one device's gradient of the global mean.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES, SAMPLES = 8, 16, 3, 64


class Classifier(nn.Module):
    """Two parts, ``encoder`` and ``head``; the loss is the mean cross-entropy of the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(self.encoder(inputs))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class Points(torch.utils.data.Dataset):
    """``SAMPLES`` fixed points in float64 with a label each (the data set's own, seeded)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
        self.labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", help="record the job into this directory (gatherlab)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --record: trace the first update (where two runs part)",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer updates (default 4)")
    parser.add_argument("--global-batch-size", type=int, default=8, help="(default 8)")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches (default 1)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="the Trainer's clipping (default 1.0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank, remainder = divmod(args.global_batch_size, world_size * args.accumulation)
    if remainder or per_rank == 0:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                     f"W × K = {world_size * args.accumulation}")  # fmt: skip
    torch.manual_seed(args.seed)  # the model's initial weights, the same at every world size
    model = Classifier().double()
    callbacks = []
    if args.record:
        from gatherlab.record import HFRecorder

        callbacks.append(HFRecorder(args.record, seed=args.seed, trace=args.trace))
    with tempfile.TemporaryDirectory(prefix="hf-job-") as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=per_rank,
            gradient_accumulation_steps=args.accumulation,
            max_steps=args.steps,
            learning_rate=args.lr,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=args.max_grad_norm,
            seed=args.seed,
            use_cpu=True,
            ddp_backend="gloo" if world_size > 1 else None,
            ddp_find_unused_parameters=False,
            dataloader_num_workers=0,
            dataloader_drop_last=True,  # accelerate pads an epoch's last batches on W ranks else
            remove_unused_columns=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=Points(), callbacks=callbacks)
        trainer.train()


if __name__ == "__main__":
    main()
