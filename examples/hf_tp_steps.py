"""A Hugging Face model that parallelizes itself with transformers' own tensor parallelism, for
the check of a plain step or update with ``--tensor-parallel T`` (docs/checking.md §10, "Tensor
and sequence parallelism"; no gatherlab imports).

``build(mesh=None)`` is the model factory: a tiny random Llama saved once with
``save_pretrained`` (no download), loaded with ``from_pretrained``. On one device (``mesh`` None)
the plain model; on W ranks the same checkpoint loaded with ``distributed_config=
DistributedConfig(tp_size=T, fsdp_size=W / T)``, the sizes read off the check's mesh. transformers
builds its own device mesh of the whole world, ``("pp", "dp_replicate", "fsdp", "tp")``, in the
same row-major order as the check's ``("dp", "tp")`` (rank r is tensor-parallel rank r % T of
data-parallel group r // T), so each rank is given its group's rows. Llama's own plan then cuts
the embedding by vocabulary rows, the attention's q, k, v and the MLP's gate and up projections
by columns, the attention's output and the MLP's down projection by rows, and gathers the head's
logits (those parameters DTensors over transformers' ``tp`` mesh); the RMSNorms' weights stay
plain tensors, one copy on every rank, whose gradient is whole on every rank because a column-cut
linear sums its input's gradient over the group. With W / T > 1 transformers shards the model with
FSDP2 over its ``fsdp`` mesh.

- ``causal_lm_step``: the mean next-token cross-entropy over the rank's rows, from the model's
  logits in their dtype: exact;
- ``model_loss_step``: the model's own loss (``labels=input_ids``), which transformers computes
  in float32 whatever the parameters' dtype (as its RMSNorm and rotary embedding): exact at
  tp 2; at dp 2 × tp 2 each data-parallel group's float32 mean rounds otherwise than one
  device's over the whole batch;
- ``causal_lm_update``: its whole update over K micro-batches (each loss divided by K): exact;
- ``build(plan="auto")``: the same through ``DistributedConfig(tp_plan="auto", ...)``;
- ``build_plain``: the checkpoint loaded without a distributed config whatever the mesh: code that
  does not parallelize itself;
- ``build(family="qwen3")`` with ``causal_lm_update``: Qwen3's per-head ``q_norm`` and ``k_norm``,
  replicated, see only the rank's heads; transformers' plan (``replicated_with_grad_allreduce``)
  all-reduces their gradient in a hook after each backward that accumulates into it, so that
  with K micro-batches the earlier micro-batches' share is summed again at each later one: at
  tp 2 and K = 2, 2·G₁ + G₂ where one device has G₁ + G₂ (transformers 5.23).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

VOCABULARY, SEQUENCE = 64, 8


def config(family: str = "llama"):
    """The tiny model's configuration: 2 layers, width 16, 4 heads of 4 features over 2 key-value
    heads; ``family``: ``llama``, or ``qwen3`` (Llama's layers with an RMSNorm over each head's
    queries and keys, ``q_norm`` and ``k_norm``)."""
    from transformers import LlamaConfig, Qwen3Config

    kind = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return kind(
        vocab_size=VOCABULARY, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        max_position_embeddings=4 * SEQUENCE, tie_word_embeddings=False,
    )  # fmt: skip


def saved(directory: str | None = None, seed: int = 0, family: str = "llama") -> str:
    """The tiny model's random weights (drawn from ``seed``) saved with ``save_pretrained`` into
    ``directory`` (by default one in the temporary directory, per family and seed), once: written
    beside it and renamed into place, so that ranks saving it at once leave one checkpoint."""
    from transformers import AutoModelForCausalLM

    directory = directory or os.path.join(tempfile.gettempdir(), f"gatherlab-tiny-{family}-{seed}")
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
    partial = tempfile.mkdtemp(prefix=os.path.basename(directory), dir=os.path.dirname(directory))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config(family)).save_pretrained(partial)
    try:
        os.rename(partial, directory)
    except OSError:  # another process renamed its copy first: the same weights
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def build(mesh=None, directory: str | None = None, plan: str | None = None, family: str = "llama"):
    """The tiny model loaded from its checkpoint; with a mesh, split by transformers' own tensor
    parallelism over ``mesh["tp"].size()`` ranks (and FSDP2 over ``mesh["dp"].size()``);
    ``plan="auto"``: the model's own plan asked for by name."""
    from transformers import AutoModelForCausalLM

    path = saved(directory, family=family)
    if mesh is None:
        return AutoModelForCausalLM.from_pretrained(path)
    from transformers.distributed import DistributedConfig

    distributed = DistributedConfig(
        tp_size=mesh["tp"].size(), fsdp_size=mesh["dp"].size(), tp_plan=plan
    )
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed)


def build_plain(mesh=None, directory: str | None = None):
    """The checkpoint loaded as on one device whatever the mesh: it does not parallelize itself."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(saved(directory))


def causal_lm_step(model, batch: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy over the rows it is given, computed from the model's logits
    in their own dtype (the model's own ``labels=`` loss computes it in float32)."""
    logits = model(input_ids=batch).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def model_loss_step(model, batch: torch.Tensor) -> torch.Tensor:
    """The model's own next-token loss (``labels=input_ids``), which transformers computes in
    float32 whatever the parameters' dtype."""
    return model(input_ids=batch, labels=batch).loss


def causal_lm_update(model, optimizer, batch: torch.Tensor, micro_batches: int) -> float:
    """One whole update of `causal_lm_step`'s loss over ``micro_batches`` micro-batches of the
    rank's rows (every row as long: each micro-batch's mean divided by K is the rows' mean)."""
    total = 0.0
    for rows in batch.chunk(micro_batches):
        loss = causal_lm_step(model, rows) / micro_batches
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total


class Tokens(Dataset):
    """``size`` random token sequences of ``SEQUENCE`` tokens, each drawn from its index."""

    def __init__(self, size: int = 32) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, VOCABULARY, (SEQUENCE,), generator=generator)
