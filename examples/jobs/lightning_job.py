"""A Lightning ``Trainer`` job: a LightningModule of SimCLR's NT-Xent with a learnt temperature
over the all-gathered batch (``common.py``), strategy DDP (gloo on the CPU, NCCL on CUDA) when
torchrun starts it. Lightning detects torchrun's environment and runs in the processes torchrun
started, without launching its own.

    python examples/jobs/lightning_job.py --record runs/one     # one device, no process group
    torchrun --nproc-per-node 4 examples/jobs/lightning_job.py --record runs/four
    python -m gatherlab.compare runs/one runs/four

Correct (``--bug none``): `gatherlab.data.LayoutInvariantSampler` with Lightning's own sampler
replacement off (``use_distributed_sampler=False``), an exact gather, the head's batch norm over
the global batch. ``--bug`` switches one thing off: ``old-gather``, ``local-batchnorm``,
``sampler`` (one device's seeded RandomSampler, which Lightning replaces on W ranks by its
DistributedSampler, seeded by ``seed_everything``), ``divide-twice`` (the loss divided by W, then
DDP averages: every gradient 1/W). ``temperature-outside`` does not apply: DDP wraps the whole
LightningModule, the loss with its temperature included.
"""

from __future__ import annotations

import os

import common
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, RandomSampler

import gatherlab.data
import gatherlab.record

BUGS = ("old-gather", "local-batchnorm", "sampler", "divide-twice")


class SimCLRModule(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model, self.criterion = common.build(args, torch.device("cpu"))

    def training_step(self, batch, batch_index):
        view0, view1 = batch
        loss = self.criterion(*self.model(view0, view1))
        common.report(self.global_step, common.global_loss(loss))
        return loss / self.trainer.world_size if self.args.bug == "divide-twice" else loss

    def configure_optimizers(self):
        return common.optimizer(self.parameters(), self.args)

    def train_dataloader(self):
        """Built once the process group exists (the sampler reads its rank and size)."""
        dataset = common.TwoViews(self.args.samples, seed=self.args.seed, dtype=self.args.dtype)
        rows = self.args.global_batch // self.trainer.world_size
        if self.args.bug == "sampler":  # on W ranks Lightning swaps in its DistributedSampler
            generator = torch.Generator().manual_seed(self.args.seed)
            sampler = RandomSampler(dataset, generator=generator)
        else:
            sampler = gatherlab.data.LayoutInvariantSampler(
                dataset, self.args.global_batch, seed=self.args.seed
            )
        return DataLoader(dataset, batch_size=rows, sampler=sampler, drop_last=True)


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS)
    L.seed_everything(args.seed, verbose=False)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    common.refuse_global_batch(args.global_batch, int(os.environ["WORLD_SIZE"]) if launched else 1)
    module = SimCLRModule(args)
    callbacks = []
    if args.record:
        callbacks.append(
            gatherlab.record.LightningRecorder(args.record, seed=args.seed, trace=args.trace)
        )
    backend = "nccl" if args.device == "cuda" else "gloo"
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]) if launched else 1,
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        if launched else 1,
        strategy=DDPStrategy(process_group_backend=backend) if launched else "auto",
        precision="64-true" if args.dtype == torch.float64 else "32-true",
        max_steps=args.steps,
        use_distributed_sampler=args.bug == "sampler",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    common.report_weights({"backbone": module.model.backbone, "head": module.model.head,
                           "loss.log_temperature": module.criterion.log_temperature})  # fmt: skip


if __name__ == "__main__":
    main()
    common.finish()
