"""A sentence-transformers job as its users write it: a ``SentenceTransformer`` (a small BERT with
random weights and mean pooling, from a ``BertConfig`` and a local ``tokenizers`` WordLevel
tokenizer: no download), a ``datasets.Dataset`` of (anchor, positive) texts,
``SentenceTransformerTrainingArguments`` and ``SentenceTransformerTrainer``, recorded with one
callback (``HFRecorder(DIR, loss=loss)``: the trainer computes the loss outside the model).

    python examples/jobs/st_job.py --loss mnrl-gather --record runs/one
    python -m torch.distributed.run --nproc-per-node 2 examples/jobs/st_job.py \\
        --loss mnrl-gather --record runs/two
    python -m gatherlab.compare runs/one runs/two   # float32: not judged, and how to floor it

``--loss``, the sentence-transformers losses of in-batch negatives:

- ``mnrl``: ``MultipleNegativesRankingLoss``, its ``gather_across_devices`` off (each rank's
  anchors against its own rows only);
- ``mnrl-gather``: the same with ``gather_across_devices=True`` (every rank's rows);
- ``cmnrl``: ``CachedMultipleNegativesRankingLoss`` (GradCache: the batch embedded in
  mini-batches without gradients, then re-embedded with its cached gradient), gathered;
- ``gist``, ``cgist``: ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss``, a guide model (another small
  random BERT, frozen) masking the negatives it finds closer than the positive, gathered;
- ``mnsrl``: ``MultipleNegativesSymmetricRankingLoss`` (anchors to positives and back), gathered;
- ``cosine``: ``CosineSimilarityLoss`` on a ``score`` column (a seeded number in [0, 1] per pair):
  a loss of each pair alone, no rows meet, so that accumulation changes nothing but the loss's
  scale: what the trainer does with it across micro-batches is judged.

The global batch is the same at every world size: each rank takes ``--global-batch-size / (W ×
K)`` rows per forward, K = ``--accumulation``, and the trainer's own batch sampler
(``--batch-sampler batch``: one seeded sampler whose per-device batches accelerate deals to the
ranks in turn) gives every W one device's batches. ``--batch-sampler no-duplicates``
(sentence-transformers' ``NoDuplicatesBatchSampler``, which keeps a text out of a batch that holds
it already) builds per-device batches, so that W ranks avoid duplicates within smaller batches than
one device: on data with repeated texts (``--duplicates``) the global batches differ. Its fix as a
user wires it, ``--batch-sampler global-no-duplicates``: the trainer's documented hook
(``batch_sampler=`` a callable) building the batches at the global batch size and cutting each
into the per-device ones, in order (`global_batches`). ``--bug desync`` raises rank 1's learning
rate by 1 % from update 2: the ranks drift apart, silently. ``--bug unscaled-accumulation`` tells
the trainer that the loss is normalized over the accumulated batch already
(``loss_is_scaled_for_ga = True``, the Trainer's documented switch for a ``compute_loss`` of one's
own), while it is each micro-batch's mean: the trainer no longer divides by K, and each update is
K × one device's. Its row turns the trainer's clipping off (``--max-grad-norm 0``): clipped at the
trainer's default norm 1, the K × gradient is cut back to norm 1, and the ratio shown is 1 / |g|.

In float32, the trainer's default (``--dtype float64`` to judge to float64's 1e-10), its texts of
different lengths, each device batch padded to its own longest, dropout off (BERT's dropout would
draw other masks on W ranks). A float32 comparison is judged in floors of the one-device run's
floor, recorded by the same command with one variable::

    GATHERLAB_RECORD_FLOOR=runs/one-floor python examples/jobs/st_job.py --record runs/one
    python -m gatherlab.compare runs/one runs/two --floor runs/one-floor

Rank 0 prints ``update U loss L`` per update.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

LOSSES = ("mnrl", "mnrl-gather", "cmnrl", "gist", "cgist", "mnsrl", "cosine")
SAMPLERS = ("batch", "no-duplicates", "global-no-duplicates")
BUGS = ("desync", "unscaled-accumulation")
VARIANTS = {  # experiments/jobs.py's rows: name → (the W ranks' arguments, one device's)
    **{loss: (["--loss", loss], ["--loss", loss]) for loss in LOSSES},
    "no-duplicates": (["--duplicates", "--batch-sampler", "no-duplicates"],
                      ["--duplicates", "--batch-sampler", "no-duplicates"]),
    "global-no-duplicates": (["--duplicates", "--batch-sampler", "global-no-duplicates"],
                             ["--duplicates", "--batch-sampler", "global-no-duplicates"]),
    "mnrl-gather, K = 2": (["--accumulation", "2"], []),
    "cmnrl, K = 2": (["--loss", "cmnrl", "--accumulation", "2"], ["--loss", "cmnrl"]),
    "cosine, K = 2": (["--loss", "cosine", "--accumulation", "2"], ["--loss", "cosine"]),
    "cosine, K = 2, unscaled-accumulation, no clipping": (
        ["--loss", "cosine", "--accumulation", "2", "--bug", "unscaled-accumulation",
         "--max-grad-norm", "0"],
        ["--loss", "cosine", "--max-grad-norm", "0"],
    ),
    "desync": (["--bug", "desync"], []),
}  # fmt: skip
WORDS = [f"w{i}" for i in range(48)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", metavar="DIR", help="record the job with gatherlab.record")
    parser.add_argument(
        "--trace", action="store_true", help="with --record: trace the first update"
    )
    parser.add_argument("--loss", choices=LOSSES, default="mnrl-gather")
    parser.add_argument("--steps", type=int, default=4, help="optimizer updates (default 4)")
    parser.add_argument("--global-batch-size", type=int, default=16, help="(default 16)")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches (default 1)")
    parser.add_argument("--samples", type=int, default=64, help="text pairs (default 64)")
    parser.add_argument("--batch-sampler", choices=SAMPLERS, default="batch")
    parser.add_argument(
        "--duplicates", action="store_true", help="every 4th anchor repeats the one before it"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="the trainer's gradient clipping, 0: none (default 1.0)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="the model's parameters (default float32, the trainer's)")  # fmt: skip
    parser.add_argument("--bug", choices=("none", *BUGS), default="none")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank, left = divmod(args.global_batch_size, world * args.accumulation)
    if left or per_rank == 0:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of W × K = "
                     f"{world * args.accumulation}")  # fmt: skip
    args.per_rank, args.world = per_rank, world
    return args


def tokenizer_dir(directory: str) -> None:
    """A WordLevel tokenizer over `WORDS` (and BERT's special tokens), saved where transformers
    loads it from."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    vocabulary |= {word: i + 4 for i, word in enumerate(WORDS)}
    tokens = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokens.pre_tokenizer = pre_tokenizers.Whitespace()
    tokens.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    special = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
    }
    PreTrainedTokenizerFast(tokenizer_object=tokens, **special).save_pretrained(directory)


def small_model(seed: int, directory: str, dtype: str = "float32"):
    """A SentenceTransformer of a 2-layer BERT (hidden size 32, random weights drawn from
    ``seed``, dropout off) and mean pooling, its parameters in ``dtype`` (float32, the
    trainer's default)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(WORDS) + 4, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(directory)
    tokenizer_dir(directory)
    model = SentenceTransformer(modules=[Transformer(directory, max_seq_length=16), Pooling(32)],
                                device="cpu")  # fmt: skip
    return model.to(getattr(torch, dtype))


def texts(samples: int, seed: int, duplicates: bool, scores: bool = False):
    """``samples`` (anchor, positive) pairs drawn from ``seed``, of different lengths as
    sentences are: an anchor of 3 to 7 words, a positive of the anchor's first three and 0 to 4
    words of its own (the tokenizer pads each device batch to its own longest). ``duplicates``:
    every fourth anchor repeats the one before it. ``scores``: a third column, ``score``, a number
    in [0, 1] per pair (drawn after the words: the texts are the same either way)."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    anchors, positives = [], []
    for i in range(samples):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (11,), generator=generator)]
        extra, own = (int(n) for n in torch.randint(0, 5, (2,), generator=generator))
        anchors.append(anchors[-1] if duplicates and i % 4 == 3 else " ".join(words[: 3 + extra]))
        positives.append(" ".join(words[:3] + words[7 : 7 + own]))
    columns = {"anchor": anchors, "positive": positives}
    if scores:
        columns["score"] = torch.rand(samples, generator=generator, dtype=torch.float64).tolist()
    return Dataset.from_dict(columns)


def loss_of(name: str, model, directory: str):
    from sentence_transformers.sentence_transformer import losses

    if name in ("gist", "cgist"):
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        guide = small_model(1234, directory + "-guide", dtype)
        guide.requires_grad_(False)
        if name == "gist":
            return losses.GISTEmbedLoss(model, guide, gather_across_devices=True)
        return losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=4,
                                          gather_across_devices=True)  # fmt: skip
    if name == "cmnrl":
        return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4,
                                                         gather_across_devices=True)  # fmt: skip
    if name == "cosine":
        return losses.CosineSimilarityLoss(model)
    if name == "mnsrl":
        return losses.MultipleNegativesSymmetricRankingLoss(model, gather_across_devices=True)
    return losses.MultipleNegativesRankingLoss(model, gather_across_devices=name == "mnrl-gather")


def global_batches(make: Callable, global_batch_size: int) -> Callable:
    """The trainer's ``batch_sampler`` hook for a batch sampler that must see the global batch
    (``make(dataset, batch_size=..., ...)``): built at the global batch size, each of its batches
    cut into the per-device batches the trainer asks for, in order. accelerate deals those to the
    ranks in turn, so the W · K per-device batches of an update are one global batch at every W."""
    from sentence_transformers.base.sampler import DefaultBatchSampler

    class GlobalBatches(DefaultBatchSampler):
        def __init__(self, dataset, batch_size: int, drop_last: bool, **kwargs):
            self.whole = make(dataset, batch_size=global_batch_size, drop_last=True, **kwargs)
            self.batch_size, self.drop_last = batch_size, drop_last

        def __iter__(self) -> Iterator[list[int]]:
            for batch in self.whole:
                for start in range(0, len(batch), self.batch_size):
                    yield batch[start : start + self.batch_size]

        def __len__(self) -> int:
            return len(self.whole) * (global_batch_size // self.batch_size)

        def set_epoch(self, epoch: int) -> None:
            self.whole.set_epoch(epoch)

    return GlobalBatches


def batch_sampler(name: str, global_batch_size: int):
    from sentence_transformers.base.sampler import BatchSamplers, NoDuplicatesBatchSampler

    if name == "no-duplicates":
        return BatchSamplers.NO_DUPLICATES
    if name == "global-no-duplicates":
        return global_batches(NoDuplicatesBatchSampler, global_batch_size)
    return BatchSamplers.BATCH_SAMPLER


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to download
    missing = [name for name in ("sentence_transformers", "datasets", "transformers")
               if importlib.util.find_spec(name) is None]  # fmt: skip
    if missing:  # before anything is built: one line, the extra to install
        print(f"st_job: needs {', '.join(missing)}; install them with: pip install "
              "'gatherlab[st]'", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import PrinterCallback, TrainerCallback

    work = tempfile.mkdtemp(prefix="st-job-")
    model = small_model(args.seed, os.path.join(work, "model"), args.dtype)
    loss = loss_of(args.loss, model, os.path.join(work, "model"))

    class Report(TrainerCallback):
        """``update U loss L`` per update on rank 0, and ``--bug desync``'s learning rate."""

        def on_step_begin(self, training, state, control, optimizer=None, **kwargs):
            if args.bug == "desync" and state.global_step == 2 and int(os.environ.get("RANK", 0)):
                for group in getattr(optimizer, "optimizer", optimizer).param_groups:
                    group["lr"] *= 1.01  # rank 1 alone: the ranks step apart from here

        def on_log(self, training, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"update {state.global_step - 1} loss {logs['loss']!r}", flush=True)

    callbacks = [Report()]
    if args.record:
        from gatherlab.record import HFRecorder

        callbacks.append(HFRecorder(args.record, loss=loss, seed=args.seed, trace=args.trace))
    training = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(work, "out"), per_device_train_batch_size=args.per_rank,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
        learning_rate=args.lr, max_grad_norm=args.max_grad_norm, lr_scheduler_type="constant",
        optim="sgd", seed=args.seed,
        batch_sampler=batch_sampler(args.batch_sampler, args.global_batch_size),
        dataloader_drop_last=True, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, ddp_backend="gloo" if args.world > 1 else None,
        ddp_find_unused_parameters=True,  # BERT's pooler: mean pooling never uses it
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(
        model=model, args=training, loss=loss, callbacks=callbacks,
        train_dataset=texts(args.samples, args.seed, args.duplicates, args.loss == "cosine"),
    )  # fmt: skip
    if args.bug == "unscaled-accumulation":  # the trainer believes the loss normalized over K
        trainer.loss_is_scaled_for_ga = True
    trainer.remove_callback(PrinterCallback)  # the job prints its own line per update
    trainer.train()


def leave_group() -> None:
    """The process group, where torchrun's ranks joined one, left by every rank together once
    the job's trainer, model and wrappers are freed (collected first). Measured here at W = 4
    under load: a rank whose DDP wrapper was freed after its group was destroyed hung its exit
    (2 of 3 launches); gloo aborts a rank whose peer leaves first (1 of ~10 two-rank Trainer
    launches without the barrier)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()  # a refusal of the recorder's says its one line and ends the job itself
    leave_group()
