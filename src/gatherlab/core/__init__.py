"""The words, errors and file formats every layer shares.

Modules:

- ``terms``: the vocabularies as ``StrEnum``s, the rows a rank holds, an integer option's rule
- ``gradients``: a comparison's arithmetic: tolerances, cosine, norm ratio, factors, ``classify``
- ``floor``: a low precision judged against a measured floor: the floor, the score, the verdict
- ``parts``: the parts of a model's gradient, named once for the check and the recorder
- ``held``: one device's parameters from the pieces ranks hold (stages, experts), copies that differ
- ``imports``: ``locate``, the one resolver of import paths; ``place``, a ``file:line`` on any rank
- ``cli``: what the command lines share: an error as one line, its exit, the end
- ``runfiles``: the files of a run: names, columns, ``Trained``, ``refuse_finished``
"""
