"""The training layer: a run trained on a rank, whatever it trains (docs/design.md §4).

- `spec`: `RunSpec`, the one description of a run, and `Form`, the protocol every training form
  implements (``train_on_rank(spec)``; ``trace_on_rank(spec)`` where it can be traced): the
  check trains any form as ``ranks_for(W).run(form.train_on_rank, spec)``;
- `loss`: a loss on the check's small model, plain DDP in float64 (`Loss`);
- `record`: the one record of a run's steps (local losses, gradient norms, the first gradient,
  the global loss over ranks, the final parameters);
- `removals`: the removals of docs/design.md §10, each defined in one place;
- `plainstep`: a user's plain PyTorch step trained on a rank (torch's DDP, no Lightning, `Step`);
- `update`: a user's whole optimizer update trained on a rank (`Update`);
- `lightning`: the callbacks of every Lightning run, and a user's LightningModule trained on a
  rank (`Module`; imports Lightning: only for a LightningModule).

The lab trains its runs with this layer, and the check (`gatherlab.check`) trains what it
compares with it; neither is imported here.
"""
