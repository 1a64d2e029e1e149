"""What a run is made of and how it is built: the models, data sets, augmentations, global batch
norm and optimizers, the LightningModule, the recipe that builds a loss, module or data set inside
each rank, and the configs that name them all (Hydra composition of conf/).

Modules:

- ``config``: Hydra composition: a job's config, a sweep's jobs, a group's options, ``_target_``
- ``factory``: ``Recipe``, a loss, module or data set built inside each rank after its group exists
- ``models``: the models that map a view to its embedding, the same initial weights in every layout
- ``data``: data sets of view pairs, and the samplers that give every layout the same global batches
- ``augment``: seeded augmentations: a sample's views the same on whichever rank loads it
- ``batchnorm``: batch normalisation over the global batch, on any backend
- ``optimizers``: LARS, the optimizer of SimCLR's large-batch runs
- ``module``: gatherlab's LightningModule, a model trained with a contrastive loss, its data module
- ``accumulation``: how the module's K micro-batches make one optimizer update
- ``rowblocks``: a forward in row blocks, the perturbation that measures a low precision's floor
- ``sharding``: ``Sharding``, how the lab distributes its module over its ranks (``conf/strategy/``)
- ``pipeline``: ``PipelineModule``, a language model trained in pipeline stages (``strategy=pp``)
"""
