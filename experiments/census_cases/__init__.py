"""The census's cases (``experiments/census.py``), one module per released package: the files
each loss needs, what is stubbed, the adapter that makes the loss ``loss(z0, z1)``, the flags
checked, the remark under the table, and for a loss that is not exact its fix, a patch file in
``fixes/<package>/`` (``common.Fix``) tried on a copy of the released files. A loss that calls
the model itself (GradCache's ``Cached*`` losses) is checked on the path training takes instead:
its adapter's ``model_for(model)`` builds the model the loss is handed around the check's MLP,
and its forward is ``loss(model, view0, view1)``, the model DDP-wrapped on real ranks and put
into the loss as the trainer puts it (``common.hand_model``).

An adapter is a top-level name of its module: the check's ranks import it (the pool sends them
the census's import path, ``experiments/``) and build the loss themselves, each loading the
released files on its first build (``public_code.load``). ``root`` is the folder the release (or
its fixed copy) was unpacked into; the census passes it.

Inputs: the check gives every loss two views (``z0``, ``z1``: the MLP's 16-dimensional embeddings
of a pair of Gaussian views, float64, 16 rows over all ranks). What a loss takes besides them
(region masks, grids) is a case's ``inputs`` (the check's ``inputs=``: made once for the global
batch, each rank given its rows); an adapter that needs anything else builds it from them in its
forward, and its docstring says how. The public threads a row answers are in ``threads``.

A new package is one module here with its ``CASES`` (and ``NOT_RUN``), its patches under
``fixes/<module>/``, and its name in ``PACKAGES``. The census needs the package registry; the
test suite imports these modules (no released file is loaded until an adapter is built).
"""

from __future__ import annotations

import dataclasses

from census_cases import (
    coca_pytorch,
    lavis,
    lightly,
    lightning_bolts,
    nemo,
    open_clip,
    pylate,
    pytorch_metric_learning,
    sentence_transformers,
    simclr,
    solo_learn,
    torchmultimodal,
    vissl,
    x_clip,
)
from census_cases.common import Case, NotRun
from census_cases.threads import THREADS

PACKAGES = (  # in the table's order
    lightly, open_clip, sentence_transformers, pylate, pytorch_metric_learning, solo_learn,
    simclr, x_clip, coca_pytorch, torchmultimodal, lavis, lightning_bolts, vissl,
    nemo,
)  # fmt: skip
CASES: list[Case] = [
    dataclasses.replace(c, threads=THREADS.get((c.package, c.version, c.loss, c.flags), ()))
    for package in PACKAGES
    for c in package.CASES
]
assert {(c.package, c.version, c.loss, c.flags) for c in CASES if c.threads} == set(THREADS), (
    "a thread's row is no case of the census"
)
NOT_RUN: list[NotRun] = [  # in the committed table's order
    *lightly.NOT_RUN, *sentence_transformers.NOT_RUN, *solo_learn.NOT_RUN, *vissl.NOT_RUN,
    *torchmultimodal.NOT_RUN, *lavis.NOT_RUN, *lightning_bolts.NOT_RUN, *pylate.NOT_RUN,
    *nemo.NOT_RUN,
]  # fmt: skip
