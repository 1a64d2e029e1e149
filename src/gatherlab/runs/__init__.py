"""The training layer: a run trained on a rank, whatever it trains (docs/design.md §4).

Modules:

- ``spec``: ``RunSpec``, the one description of a run, and ``Form``, what a training form implements
- ``loss``: the loss form: a loss on the check's small model, plain DDP in float64 (``Loss``)
- ``plainstep``: a user's plain PyTorch step, trained with torch's DDP and no Lightning (``Step``)
- ``update``: a user's whole optimizer update, its micro-batches included (``Update``)
- ``fit``: training with Lightning: every Lightning run's callbacks, a user's module (``Module``)
- ``steplog``: ``StepLog``, the one record of a run's steps, whatever trains it
- ``removals``: the removals a training step's check makes, each one member of ``Removal``
- ``precision``: a run in its precision: dtypes, autocast, the floor's perturbation, ``in_float64``
- ``trace``: the operations of one forward, recorded with their ``file:line`` and gradients
- ``sharded``: sharded code: a sharded parameter used outside its forward, DDP's unused parameters
- ``tensorparallel``: a model that parallelizes itself with torch's DTensor over the ``tp`` mesh
- ``stages``: a pipeline's stages on its ranks: one device's parameters from their pieces, losses

The check trains any form as ``ranks_for(W).run(form.train_on_rank, spec)``; only ``fit`` imports
Lightning. The lab trains its runs with this layer, and the check (`gatherlab.check`) trains what it
compares with it; neither is imported here.
"""
