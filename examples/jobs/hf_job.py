"""A Hugging Face ``Trainer`` job as its users write it, recorded with one line
(``callbacks=[HFRecorder(DIR)]``): a small BERT sequence classifier
(``BertForSequenceClassification`` from a ``BertConfig``, random weights, and a local WordLevel
tokenizer, no download), texts of different lengths tokenized without padding and padded per
device batch by ``DataCollatorWithPadding``, the model's own loss, the Trainer's sampler, gradient
clipping and optimizer, in float32 (the Trainer's default; ``--dtype float64`` to judge to
float64's 1e-10, ``--bf16`` for its bf16 autocast). The global batch is the same at every world
size: each rank takes ``--global-batch-size / (W × K)`` rows per forward, K =
``--accumulation``. One process, and torchrun's ranks (gloo)::

    python examples/jobs/hf_job.py --record runs/hf_w1
    python -m torch.distributed.run --nproc-per-node 2 examples/jobs/hf_job.py --record runs/hf_w2
    python -m gatherlab.compare runs/hf_w1 runs/hf_w2   # float32: how to record the floor
    GATHERLAB_RECORD_FLOOR=runs/hf_w1-floor python examples/jobs/hf_job.py --record runs/hf_w1
    python -m gatherlab.compare runs/hf_w1 runs/hf_w2 --floor runs/hf_w1-floor

At the Trainer's defaults the W ranks' gradient is W times one device's, and K micro-batches'
K times (measured: class ``W``, norm ratio 2 at W = 2 in float64 with ``--max-grad-norm 0``; with
the default clipping at norm 1 the ratio read is 1/|g₁|, class ``other``). transformers 5.23's
Trainer takes a model whose forward accepts ``**kwargs`` for one that divides its loss by
``num_items_in_batch`` (the items of the global batch): it then multiplies the loss by the number
of processes to undo DDP's average (``average_tokens_across_devices=True``, its default) and no
longer divides it by K. ``BertForSequenceClassification`` accepts ``**kwargs`` but returns the
mean cross-entropy of the rank's micro-batch. ``--mean-loss`` tells the Trainer so, with its two
documented settings (``average_tokens_across_devices=False``, ``loss_is_scaled_for_ga = False``),
and the recordings agree to rounding: accelerate gives rank r the r-th of every W consecutive
per-rank batches of one seeded sampler, which together are one device's batch, and DDP averages
the ranks' gradients of their mean losses, which is one device's gradient of the global mean
(each row's logits are its own, however its batch is padded). Dropout off: BERT's would draw
other masks on W ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from st_job import WORDS, leave_group, tokenizer_dir

CLASSES, SAMPLES = 3, 64
VARIANTS = {  # experiments/jobs.py's rows: name → (the W ranks' arguments, one device's)
    "defaults": ([], []),
    "defaults, no clipping": (["--max-grad-norm", "0"], ["--max-grad-norm", "0"]),
    "mean-loss": (["--mean-loss"], ["--mean-loss"]),
    "defaults, K = 2, no clipping": (["--accumulation", "2", "--max-grad-norm", "0"],
                                     ["--max-grad-norm", "0"]),
    "mean-loss, K = 2": (["--mean-loss", "--accumulation", "2"], ["--mean-loss"]),
}  # fmt: skip


def sentences(samples: int = SAMPLES, seed: int = 1234) -> list[tuple[str, int]]:
    """``samples`` texts of 2 to 9 words drawn from ``seed``, each labelled by its first word
    (its index in `WORDS` modulo `CLASSES`)."""
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(samples):
        length = int(torch.randint(2, 10, (1,), generator=generator))
        words = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        texts.append((" ".join(WORDS[w] for w in words), words[0] % CLASSES))
    return texts


class Texts(torch.utils.data.Dataset):
    """The texts tokenized one by one, unpadded (the collator pads each batch)."""

    def __init__(self, tokenizer, samples: int = SAMPLES) -> None:
        self.items = [{**tokenizer(text), "labels": label} for text, label in sentences(samples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def classifier(seed: int, dtype: str = "float32"):
    """A 2-layer BERT (hidden size 32, dropout off) with a classification head of `CLASSES`,
    its random weights drawn from ``seed``, in ``dtype``."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(WORDS) + 4, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        num_labels=CLASSES)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    return model.to(getattr(torch, dtype))


def tokenizer(directory: str):
    from transformers import AutoTokenizer

    tokenizer_dir(directory)
    return AutoTokenizer.from_pretrained(directory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", help="record the job into this directory (gatherlab)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --record: trace the first update (where two runs part)",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer updates (default 4)")
    parser.add_argument("--global-batch-size", type=int, default=8, help="(default 8)")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches (default 1)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="the Trainer's clipping (default 1.0)"
    )
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="the model's parameters (default float32, the Trainer's)")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="the Trainer's bf16 autocast")
    parser.add_argument("--mean-loss", action="store_true",
                        help="tell the Trainer the model's loss is the mean of the rank's rows "
                        "(see the module's docstring)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to download

    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank, remainder = divmod(args.global_batch_size, world_size * args.accumulation)
    if remainder or per_rank == 0:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                     f"W × K = {world_size * args.accumulation}")  # fmt: skip
    callbacks = []
    if args.record:
        from gatherlab.record import HFRecorder

        callbacks.append(HFRecorder(args.record, seed=args.seed, trace=args.trace))
    with tempfile.TemporaryDirectory(prefix="hf-job-") as work:
        words = tokenizer(os.path.join(work, "tokenizer"))
        training = TrainingArguments(
            output_dir=os.path.join(work, "out"),
            per_device_train_batch_size=per_rank,
            gradient_accumulation_steps=args.accumulation,
            max_steps=args.steps,
            learning_rate=args.lr,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=args.max_grad_norm,
            bf16=args.bf16,
            average_tokens_across_devices=not args.mean_loss,
            seed=args.seed,
            use_cpu=True,
            ddp_backend="gloo" if world_size > 1 else None,
            ddp_find_unused_parameters=False,
            dataloader_num_workers=0,
            dataloader_drop_last=True,  # accelerate pads an epoch's last batches on W ranks else
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=classifier(args.seed, args.dtype), args=training, train_dataset=Texts(words),
            data_collator=DataCollatorWithPadding(words), callbacks=callbacks,
        )  # fmt: skip
        if args.mean_loss:  # the Trainer's documented switch: divide the loss by K itself
            trainer.loss_is_scaled_for_ga = False
        trainer.train()


if __name__ == "__main__":
    main()
    leave_group()
