"""The recorder on transformers' own tensor parallelism (issue 70, docs/recording.md §11, "Hugging
Face's own tensor parallelism"): a tiny random Qwen3 loaded with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`` on 2 ranks of the pool,
recorded with the one documented line and compared with its one-device recording, with one
micro-batch and with two. transformers 5.23 all-reduces the per-head norms' gradient after every
backward (its ``replicated_with_grad_allreduce``), so the update of two micro-batches departs: the
recorder and the comparison show it as they would show a user's slip."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gatherlab.compare import compare
from gatherlab.ranks import pool as pools
from gatherlab.ranks import world
from gatherlab.record import read

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="needs the hf extra: pip install 'gatherlab[hf]'",
    ),
]


def _recorded(out: str, directory: str, micro_batches: int) -> None:
    """Two updates of the Qwen3 (on this rank's mesh, or plain without a process group) on the
    first 16 rows, 8 an update, each update's loss the model's own over ``micro_batches``
    micro-batches (each divided by their number), SGD, recorded into ``out``."""
    import hf_tp_steps

    import gatherlab.record

    mesh = world.mesh(2) if world.size() > 1 else None
    model = hf_tp_steps.build(mesh, directory=directory, family="qwen3").double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = torch.stack([hf_tp_steps.Tokens()[i] for i in range(16)])
    with gatherlab.record(model, optimizer, out):
        for batch in rows.chunk(2):
            optimizer.zero_grad()
            for micro_batch in batch.chunk(micro_batches):
                loss = model(input_ids=micro_batch, labels=micro_batch).loss / micro_batches
                loss.backward()
            optimizer.step()


@pytest.mark.timeout(300)
def test_a_transformers_tensor_parallel_models_recording_shows_its_accumulation_departure(
    tmp_path,
):
    import hf_tp_steps

    directory = hf_tp_steps.saved(str(tmp_path / "qwen3"), family="qwen3")
    verdicts = {}
    for k in (1, 2):
        one, ranks = str(tmp_path / f"one-k{k}"), str(tmp_path / f"tp2-k{k}")
        _recorded(one, directory, k)
        pools.pool(2).run(_recorded, ranks, directory, k)
        assert read(ranks).row_groups == [[0, 1]]  # the tensor-parallel group's rows, once
        comparison = compare(one, ranks)
        assert comparison.data is None, comparison.words  # the same rows, once
        verdicts[k] = comparison
    assert (verdicts[1].verdict, verdicts[1].status) == ("exact", 0), verdicts[1].words
    departed = verdicts[2]
    assert (departed.verdict, departed.departure) == ("biased", (0, "model")), departed.words
    parts = departed.table.set_index("part")
    assert parts.loc["lm_head", "gradient"] == "exact", departed.words
