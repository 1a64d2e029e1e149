"""A causal language model trained with transformers' own tensor parallelism, as its users write
it: a tiny Llama (``LlamaForCausalLM`` from a ``LlamaConfig``, random weights drawn from
``--seed``, saved with ``save_pretrained`` and loaded with ``from_pretrained``: no download) and a
local WordLevel tokenizer, texts tokenized, concatenated and cut into blocks of ``BLOCK`` tokens
(transformers' ``run_clm`` example's ``group_texts``), the model's own next-token loss, AdamW, in
float32 (transformers' default; ``--dtype float64`` to judge to float64's 1e-10). Recorded with
the one documented line, ``gatherlab.record(model, optimizer, DIR)`` on every rank.

    python examples/jobs/hf_tp.py --record runs/one                # one device, no process group
    torchrun --nproc-per-node 2 examples/jobs/hf_tp.py --record runs/tp2
    torchrun --nproc-per-node 4 examples/jobs/hf_tp.py --record runs/dp2tp2   # dp 2 × tp 2
    GATHERLAB_RECORD_FLOOR=runs/one-floor python examples/jobs/hf_tp.py --record runs/one
    python -m gatherlab.compare runs/one runs/tp2 --floor runs/one-floor

Under torchrun the checkpoint is loaded with ``distributed_config=DistributedConfig(tp_size=tp,
fsdp_size=W / tp)`` (``--tp`` 2 by default): transformers builds its device mesh of the whole
world, ``("pp", "dp_replicate", "fsdp", "tp")``, and applies Llama's own plan over ``tp`` (the
attention's q, k, v and the MLP's gate and up projections cut by columns, the attention's output
and the MLP's down projection by rows, the head's logits gathered; the embedding and the RMSNorms
stay plain tensors, a whole copy on every rank), then FSDP2 over ``fsdp`` when W > tp. The ranks
of a tensor-parallel group train the same rows (their data-parallel rank's, rank // tp, the mesh's
row-major order), which the recorder counts once: it reads the groups off the parameters' mesh.

The gradient is clipped to ``--max-grad-norm`` (0.5 by default, below its norm at the start, so
that it clips) by its norm over every parameter, as transformers' ``Trainer`` clips a model whose
gradients lie on several device meshes (`clip`): torch's ``clip_grad_norm_(model.parameters())``
raises on this model, ``aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor`` (the
RMSNorms' weights are plain tensors; at W > tp they are FSDP2's DTensors over another mesh than
the cut ones').

``--bug`` switches one thing, a user's slip that trains without an error:

- ``clip-per-mesh``: ``clip_grad_norm_`` called on each mesh's parameters apart, the way round
  that error: each group clipped by its own norm instead of the whole gradient's, so the groups
  are scaled by different factors (on one device, one group: the same clipping);
- ``own-rows``: the sampler over every rank (``num_replicas=W``, as for DDP) instead of the
  data-parallel groups: each rank of a tensor-parallel group is given other rows, and its shards
  of one model compute on them as if they were one batch (the recorder refuses it at update 0,
  in one line: a group's ranks give their model different rows).

Rank 0 prints ``update U loss L`` per update and ``weights PART NORM`` at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import common
import torch
import torch.distributed as dist
from st_job import WORDS, tokenizer_dir
from torch.utils.data import DataLoader, Dataset

import gatherlab.data
import gatherlab.record

BUGS = ("clip-per-mesh",)
REFUSED = ("own-rows",)  # the recorder refuses it: no recording to compare
BLOCK, TEXTS = 8, 96


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", metavar="DIR", help="record the job with gatherlab.record")
    parser.add_argument("--steps", type=int, default=5, help="optimizer updates (default 5)")
    parser.add_argument("--global-batch", type=int, default=8, help="blocks per update (default 8)")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree (default 2)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=0.5,
                        help="clip the gradient to this norm (default 0.5)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="the model's parameters (default float32, transformers')")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bug", choices=("none", *BUGS, *REFUSED), default="none")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    return args


def texts(count: int = TEXTS, seed: int = 1234) -> list[str]:
    """``count`` texts of 2 to 9 words of `WORDS`, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (count,), generator=generator).tolist()
    return [" ".join(WORDS[w] for w in torch.randint(0, len(WORDS), (n,), generator=generator))
            for n in lengths]  # fmt: skip


class Blocks(Dataset):
    """The texts tokenized, concatenated and cut into blocks of ``BLOCK`` tokens (the remainder
    dropped), as transformers' ``run_clm`` example groups them: every row as long, no padding;
    each item its ``input_ids``, ``attention_mask`` (ones) and ``labels`` (the ids)."""

    def __init__(self, tokenizer) -> None:
        ids = [token for text in texts() for token in tokenizer(text)["input_ids"]]
        self.blocks = torch.tensor(ids[: len(ids) // BLOCK * BLOCK]).view(-1, BLOCK)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "attention_mask": torch.ones_like(block), "labels": block}


def clip(parameters, max_norm: float, per_mesh: bool = False) -> None:
    """The gradients clipped to ``max_norm`` by their norm over every parameter (torch's
    ``clip_grad_norm_``), where they lie on several device meshes, as transformers' ``Trainer``
    clips them: each mesh's norm (a DTensor's read whole), then one norm of them all, by which
    every group is clipped. ``per_mesh``: each mesh's group clipped by its own norm (the bug)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    if per_mesh:
        for group in groups.values():
            torch.nn.utils.clip_grad_norm_(group, max_norm)
        return
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def checkpoint(directory: str, seed: int) -> None:
    """The tiny Llama's random weights drawn from ``seed``, and the tokenizer, saved into
    ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4 * BLOCK, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer_dir(directory)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to download
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if launched else (1, 0)
    tp = min(args.tp, world)
    if world % tp or args.global_batch % (world // tp):
        raise SystemExit(f"--tp {args.tp} and --global-batch {args.global_batch} do not fit "
                         f"{world} ranks; allowed: a tp dividing W, W / tp dividing the "
                         "batch")  # fmt: skip
    dp, dp_rank = world // tp, rank // tp
    with tempfile.TemporaryDirectory(prefix="hf-tp-") as work:
        where = [os.path.join(work, "llama")]
        if rank == 0:
            checkpoint(where[0], args.seed)
        if launched:  # every rank loads rank 0's checkpoint
            dist.broadcast_object_list(where, src=0)
            dist.barrier()
        distributed = DistributedConfig(tp_size=tp, fsdp_size=dp) if launched else None
        model = LlamaForCausalLM.from_pretrained(where[0], dtype=args.dtype,
                                                 distributed_config=distributed)  # fmt: skip
        data = Blocks(AutoTokenizer.from_pretrained(where[0]))
        if launched:
            dist.barrier()  # every rank has read the checkpoint before rank 0 removes it
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    replicas, replica = (world, rank) if args.bug == "own-rows" else (dp, dp_rank)
    sampler = gatherlab.data.LayoutInvariantSampler(data, args.global_batch, num_replicas=replicas,
                                                    rank=replica, seed=args.seed)  # fmt: skip
    loader = DataLoader(data, batch_size=args.global_batch // replicas, sampler=sampler,
                        drop_last=True)  # fmt: skip
    recorder = (
        gatherlab.record(model, optimizer, args.record, seed=args.seed) if args.record else None
    )
    model.train()
    for update, batch in common.batches(loader, args.steps):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        clip(model.parameters(), args.max_grad_norm, per_mesh=args.bug == "clip-per-mesh")
        optimizer.step()
        common.report(update, common.global_loss(loss))
    if recorder is not None:
        recorder.close()
    common.report_weights({"model": model.model, "lm_head": model.lm_head})


if __name__ == "__main__":
    main()
    common.finish()
