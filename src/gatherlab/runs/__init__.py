"""The training layer: a run trained on a rank, whatever it trains (docs/design.md §4).

- `record`: the one record of a run's steps (local losses, gradient norms, the first gradient,
  the global loss over ranks, the final parameters);
- `removals`: the removals of docs/design.md §10, each defined in one place;
- `plainstep`: a user's plain PyTorch step trained on a rank (torch's DDP, no Lightning);
- `lightning`: the callbacks of every Lightning run, and a user's LightningModule trained on a
  rank (imports Lightning: only for a LightningModule).

The lab trains its runs with this layer, and the check (`gatherlab.check`) trains what it
compares with it; neither is imported here.
"""
