"""What a run is made of and how it is built: the models, data sets, augmentations, global batch
norm and optimizers, the LightningModule with its recorders (`module`), the recipe that builds a
loss, module or data set inside each rank (`factory`), and the configs that name them all
(`config`: Hydra composition of conf/)."""
