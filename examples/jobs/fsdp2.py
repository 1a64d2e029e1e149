"""An FSDP2 training loop (``torch.distributed.fsdp.fully_shard`` on a DeviceMesh of the W ranks,
``init_device_mesh("cpu", (W,))`` on gloo): every parameter sharded over the ranks as a DTensor,
SimCLR's NT-Xent with a learnt temperature over the all-gathered batch (``common.py``).

    python examples/jobs/fsdp2.py --record runs/one             # one device, no process group
    torchrun --nproc-per-node 4 examples/jobs/fsdp2.py --record runs/four
    python -m gatherlab.compare runs/one runs/four

Correct (``--bug none``): the backbone, the head and the module holding model and loss are each
sharded (``fully_shard``), so the temperature's gradient is reduce-scattered with the model's.
``--bug`` switches one thing off: ``old-gather``, ``local-batchnorm``, ``sampler``,
``temperature-outside`` (the loss outside every sharded module: its temperature is a plain tensor
whose gradient each rank keeps unreduced, and the ranks drift apart), ``divide-twice`` (the loss
divided by W, then FSDP averages: every gradient 1/W).
"""

from __future__ import annotations

import contextlib

import common
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gatherlab.record

BUGS = ("old-gather", "local-batchnorm", "sampler", "temperature-outside", "divide-twice")


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS)
    world, device = common.start(args)
    model, criterion = common.build(args, device)
    outside = args.bug == "temperature-outside"
    objective = common.Objective(model, criterion)
    if common.distributed():
        mesh = init_device_mesh(device.type, (world,))
        fully_shard(model.backbone, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model if outside else objective, mesh=mesh)
    # after sharding: the optimizer holds the DTensor shards
    optimizer = common.optimizer([*model.parameters(), *criterion.parameters()], args)
    data = common.loader(common.TwoViews(args.samples, seed=args.seed, dtype=args.dtype), args,
                         world)  # fmt: skip
    recording = contextlib.nullcontext()
    if args.record:
        recording = gatherlab.record(
            model, optimizer, args.record, loss=criterion, seed=args.seed, trace=args.trace
        )
    with recording:
        for update, (view0, view1) in common.batches(data, args.steps):
            view0, view1 = view0.to(device), view1.to(device)
            loss = criterion(*model(view0, view1)) if outside else objective(view0, view1)
            optimizer.zero_grad()
            (loss / world if args.bug == "divide-twice" else loss).backward()
            optimizer.step()
            common.report(update, common.global_loss(loss))
    common.report_weights({"backbone": model.backbone, "head": model.head,
                           "loss.log_temperature": criterion.log_temperature})  # fmt: skip


if __name__ == "__main__":
    main()
    common.finish()
