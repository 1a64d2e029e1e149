"""A user's training job recorded where it runs, in one versioned format, its gradients kept as
linear sketches and its rows as fingerprints; two recordings are compared by `gatherlab.compare`
(docs/recording.md §11).

Modules:

- ``recorder``: ``Recorder``, a job recorded through torch's public hooks on every rank
- ``record_options``: ``RecordOptions``, how a job is recorded, typed and documented once
- ``rows``: the rows a model is given, fingerprinted: a 64-bit digest per row
- ``sketch``: the linear sketch of a gradient, additive over shards
- ``placed``: where a ``DTensor`` shard's elements lie in the whole tensor, for its sketch
- ``pieces``: ranks that hold different parameters (pipeline stages, experts), as one device's
- ``format``: the versioned files: ``Writer``, ``read``, ``RecordingError``
- ``refusal``: a refusal of the recorder: one line, said once, every rank ending together
- ``callbacks``: what the two trainer callbacks share: ``OneTrainer`` refuses the wrong trainer
- ``lightning``: ``LightningRecorder``, a Lightning ``Trainer``'s callback over a ``Recorder``
- ``hf``: ``HFRecorder``, a Hugging Face ``Trainer``'s callback over a ``Recorder``
"""
