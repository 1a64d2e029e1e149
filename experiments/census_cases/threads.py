"""The public threads that ask a question a census row answers, each with the sentence that
answers it (`census_pages` prints them on the finding's page, or in the index for a row without
a finding), keyed by the row's package, version, loss and flags as the table shows them. A thread
is listed only where its text was read; the sentence states what the row measured, not more."""

from __future__ import annotations

Row = tuple[str, str, str, str]  # package, version, loss, flags

THREADS: dict[Row, tuple[tuple[str, str], ...]] = {
    ("simclr", "1.0.2", "NT_Xent", "world_size=W (gathers)"): (
        ("https://github.com/Spijkervet/SimCLR/issues/30",
         "a loss that stays near ln(2N) on several nodes while one node trains: the released "
         "NT_Xent with world_size > 1 does not compute one device's loss, and its gradient is "
         "not one device's at any W measured (above); the check names the concatenation of the "
         "two views before the gather (nt_xent.py:36), and the three changes of the patch make it "
         "exact"),
        ("https://github.com/Spijkervet/SimCLR/issues/37",
         "whether multi-GPU training learns what one GPU does: not with the release (the "
         "gradient's cosine with one device's is in the table above); with the patch, exact"),
    ),
    ("lightly", "1.5.3", "DCLLoss", "gather_distributed=True"): (
        ("https://github.com/lightly-ai/lightly/issues/1528",
         "the GatherLayer whose backward keeps only the own slice's gradient: biased in 1.5.3, "
         "exact in 1.5.4, the release after the fix that sums every rank's slice gradients"),
    ),
    ("open-clip-torch", "3.3.0", "SigLipLoss", "dist_impl=bidir"): (
        ("https://github.com/mlfoundations/open_clip/issues/742",
         "the per-rank loss terms printed there differ between ranks by design; what the ranks "
         "train is exact in 3.3.0 with each dist_impl (bidir, shift, reduce, gather: the rows of "
         "the census), the global loss and the gradient one device's in float64. The check does "
         "not see what a low precision or other settings change"),
    ),
    ("open-clip-torch", "3.3.0", "ClipLoss", "local_loss=True, gather_with_grad=True"): (
        ("https://github.com/mlfoundations/open_clip/issues/894",
         "which flags train like one device: in 3.3.0 local_loss=True with gather_with_grad=True "
         "is exact, and so is gather_with_grad=True with the global loss; without "
         "gather_with_grad the global loss gives 1/W of one device's gradient and local_loss a "
         "biased one (the ClipLoss rows of the census)"),
    ),
    ("pylate", "1.6.0", "Contrastive", "gather_across_devices=True"): (
        ("https://github.com/lightonai/pylate/pull/156",
         "the scaling by the world size that this change keeps when gathering makes the loss W "
         "times one device's, and its gradient after DDP's average too, at W = 2, 4 and 8; the "
         "documents' gather already sums every rank's gradient, and without the scaling the row "
         "is exact"),
    ),
    ("pylate", "1.6.0", "CachedContrastive", "gather_across_devices=True"): (
        ("https://github.com/lightonai/pylate/pull/156",
         "the cached form scales by the world size when gathering as the plain one does, and for "
         "it the scaling is what training needs: through its forward and the replay of its "
         "cached gradients, the gradient after DDP's average is one device's at W = 2, 4 and 8, "
         "and only the returned loss is W times one device's; without the scaling the gradient "
         "is 1/W of one device's (the remark above)"),
        ("https://github.com/lightonai/pylate/pull/111",
         "the scaling by the world size this change added, to offset DDP's average: in the "
         "cached form it does (the gradient is one device's at W = 2, 4 and 8) and it leaves the "
         "returned loss W times one device's; in the plain `Contrastive` the documents' gather "
         "already sums every rank's gradient, and the scaling makes the gradient W times one "
         "device's (the census's `Contrastive` rows)"),
    ),
    ("sentence-transformers", "6.2.0", "MultipleNegativesRankingLoss",
     "gather_across_devices=True"): (
        ("https://github.com/huggingface/sentence-transformers/issues/3149",
         "how many in-batch negatives a rank's anchors meet under DDP: without "
         "gather_across_devices only the rank's own rows, and the loss and gradient differ from "
         "one device's (the row above); with gather_across_devices=True every rank's rows, and "
         "6.2.0 trains like one device at W = 2 and 4"),
    ),
    ("sentence-transformers", "6.2.0", "GISTEmbedLoss", "gather_across_devices=True"): (
        ("https://github.com/huggingface/sentence-transformers/pull/3442",
         "the change that added gather_across_devices to MNRL, CMNRL, MNSRL, CMNSRL, GIST, CGIST "
         "and SparseMNRL: in 6.2.0 each trains like one device with it, except GISTEmbedLoss "
         "and CachedGISTEmbedLoss with contrast_anchors=True (the default), whose "
         "anchor-to-anchor term stays on the rank's own anchors (Δloss 0.0221 at W = 2 and 4); "
         "with contrast_anchors=False, or with that term gathered, exact"),
    ),
    ("sentence-transformers", "6.2.0", "CachedGISTEmbedLoss", "gather_across_devices=True"): (
        ("https://github.com/huggingface/sentence-transformers/pull/3442",
         "as GISTEmbedLoss: the cached form's anchor-to-anchor term is over the rank's own "
         "anchors with gather_across_devices=True (Δloss 0.0221 at W = 2 and 4); gathered, exact"),
    ),
}  # fmt: skip
