"""A plain DDP training loop (torch's ``DistributedDataParallel``), SimCLR's NT-Xent with a learnt
temperature over the all-gathered batch (``common.py``).

    python examples/jobs/ddp.py --record runs/one               # one device, no process group
    torchrun --nproc-per-node 4 examples/jobs/ddp.py --record runs/four
    python -m gatherlab.compare runs/one runs/four

Correct (``--bug none``), W ranks train exactly as one device does: the same global batch at
every update (`gatherlab.data.LayoutInvariantSampler`), an exact gather, the head's batch norm
over the global batch, the temperature inside the module DDP wraps. ``--bug`` switches one of
these off: ``old-gather``, ``local-batchnorm``, ``sampler``, ``temperature-outside`` (DDP wraps
the model only; the temperature keeps each rank's own, unreduced gradient and the ranks drift
apart), ``divide-twice`` (the loss divided by W, then DDP averages: every gradient 1/W).
"""

from __future__ import annotations

import contextlib

import common
from torch.nn.parallel import DistributedDataParallel

import gatherlab.record

BUGS = ("old-gather", "local-batchnorm", "sampler", "temperature-outside", "divide-twice")


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS)
    world, device = common.start(args)
    model, criterion = common.build(args, device)
    optimizer = common.optimizer([*model.parameters(), *criterion.parameters()], args)
    if args.bug == "temperature-outside":
        wrapped = DistributedDataParallel(model) if common.distributed() else model

        def forward(view0, view1):
            return criterion(*wrapped(view0, view1))
    else:
        objective = common.Objective(model, criterion)
        forward = DistributedDataParallel(objective) if common.distributed() else objective
    data = common.loader(common.TwoViews(args.samples, seed=args.seed, dtype=args.dtype), args,
                         world)  # fmt: skip
    recording = contextlib.nullcontext()
    if args.record:
        recording = gatherlab.record(
            model, optimizer, args.record, loss=criterion, seed=args.seed, trace=args.trace
        )
    with recording:
        for update, (view0, view1) in common.batches(data, args.steps):
            loss = forward(view0.to(device), view1.to(device))
            optimizer.zero_grad()
            (loss / world if args.bug == "divide-twice" else loss).backward()
            optimizer.step()
            common.report(update, common.global_loss(loss))
    common.report_weights({"backbone": model.backbone, "head": model.head,
                           "loss.log_temperature": criterion.log_temperature})  # fmt: skip


if __name__ == "__main__":
    main()
    common.finish()
