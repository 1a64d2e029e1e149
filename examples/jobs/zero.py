"""A DDP training loop whose optimizer state is sharded over the ranks by torch's
``ZeroRedundancyOptimizer`` (around SGD or Adam, ``--optimizer``): each rank updates its own
partition of the parameters and broadcasts it. SimCLR's NT-Xent with a learnt temperature over
the all-gathered batch (``common.py``).

    python examples/jobs/zero.py --record runs/one              # one device, no process group
    torchrun --nproc-per-node 4 examples/jobs/zero.py --record runs/four
    python -m gatherlab.compare runs/one runs/four

Correct (``--bug none``): DDP wraps the model with its loss, so the temperature's gradient is
averaged with the model's. ``--bug`` switches one thing off: ``old-gather``, ``local-batchnorm``,
``sampler``, ``temperature-outside`` (DDP wraps the model only: the rank that owns the
temperature's partition updates it from its own, unreduced gradient and broadcasts it, so the
ranks agree with each other and not with one device: a check that compares ranks with each other
passes it), ``divide-twice`` (the loss divided by W, then DDP averages: every gradient 1/W).
Without a process group it is the optimizer itself (one device).
"""

from __future__ import annotations

import contextlib

import common
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import gatherlab.record

BUGS = ("old-gather", "local-batchnorm", "sampler", "temperature-outside", "divide-twice")


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS)
    world, device = common.start(args)
    model, criterion = common.build(args, device)
    parameters = [*model.parameters(), *criterion.parameters()]
    if common.distributed():
        kind, settings = common.optimizer_class(args)
        optimizer = ZeroRedundancyOptimizer(parameters, optimizer_class=kind, **settings)
    else:
        optimizer = common.optimizer(parameters, args)
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
