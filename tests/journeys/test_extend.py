"""A newcomer's afternoon: a new loss, gather, data set and model, each one Python file and one
YAML file in a directory outside the repository, put on Hydra's search path, used by a 2-rank
sweep with its report and loss matrix, and by the gradient audit. No file of the repository is
touched (docs/design.md §4, extension points)."""

from __future__ import annotations

import subprocess
import textwrap

import pandas as pd
import pytest
from helpers import REPO, run_command

pytestmark = pytest.mark.slow

FILES = {
    # a loss that every rank computes in full on the gathered batch (global-loss style)
    "ext_loss.py": '''
        import torch
        from torch import nn

        from gatherlab import gather as gathering


        class AlignUniformLoss(nn.Module):
            """Alignment + uniformity (Wang & Isola, 2020) of the whole gathered batch."""

            style = "global"
            layout_invariant = True

            def __init__(self, t: float = 2.0, gather="fixed"):
                super().__init__()
                if not t > 0:
                    raise ValueError(f"t={t} is not allowed; allowed: a positive number")
                self.t, self.gather = t, gathering.resolve(gather)

            def forward(self, out0, out1):
                z = self.gather(torch.cat([out0, out1], dim=1))
                z0, z1 = z[:, : out0.shape[1]], z[:, out0.shape[1] :]
                z0 = nn.functional.normalize(z0, dim=1)
                z1 = nn.functional.normalize(z1, dim=1)
                align = (z0 - z1).pow(2).sum(dim=1).mean()
                uniform = torch.pdist(z0).pow(2).mul(-self.t).exp().mean().log()
                return align + uniform
    ''',
    # a gather through an all-reduce of the zero-padded slices; its backward sums too: exact
    "ext_gather.py": """
        import torch
        import torch.distributed as dist

        from gatherlab.gather import Gather


        class _PaddedSum(torch.autograd.Function):
            @staticmethod
            def forward(ctx, tensor):
                rank, world_size = dist.get_rank(), dist.get_world_size()
                padded = tensor.new_zeros((world_size * len(tensor), *tensor.shape[1:]))
                padded[rank * len(tensor) : (rank + 1) * len(tensor)] = tensor
                dist.all_reduce(padded)
                ctx.rows = len(tensor)
                return padded

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                dist.all_reduce(grad)
                rank = dist.get_rank()
                return grad[rank * ctx.rows : (rank + 1) * ctx.rows]


        class PaddedSumGather(Gather):
            predicted = {"local": "exact", "global": "exact", "mixed": "exact"}

            def gather(self, tensor):
                return _PaddedSum.apply(tensor)
    """,
    "ext_data.py": '''
        import math

        import torch


        class Rings:
            """Two noisy views of points on concentric rings; no randomness per step."""

            encode_second_view = True

            def __init__(self, num_samples: int = 64, noise: float = 0.1, seed: int = 0):
                generator = torch.Generator().manual_seed(seed)
                angle = 2 * math.pi * torch.rand(num_samples, generator=generator)
                radius = 1.0 + torch.randint(0, 3, (num_samples,), generator=generator)
                points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
                noise0 = noise * torch.randn(points.shape, generator=generator)
                noise1 = noise * torch.randn(points.shape, generator=generator)
                self.view0 = (points + noise0).double()
                self.view1 = (points + noise1).double()

            def __len__(self):
                return len(self.view0)

            def __getitem__(self, key):
                epoch, index = key
                return self.view0[index], self.view1[index]
    ''',
    "ext_model.py": """
        from torch import nn


        class TanhNet(nn.Module):
            def __init__(self, in_features: int, width: int = 16, out_features: int = 8):
                super().__init__()
                self.net = nn.Sequential(
                    nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, out_features)
                )

            def forward(self, x):
                return self.net(x)
    """,
    "conf/loss/align_uniform.yaml": "_target_: ext_loss.AlignUniformLoss\nt: 2.0\n",
    "conf/gather/padded_sum.yaml": "_target_: ext_gather.PaddedSumGather\n",
    "conf/data/rings.yaml": (
        "dim: 2\nshuffle: true\ndataset:\n  _target_: ext_data.Rings\n  num_samples: 64\n"
    ),
    "conf/model/tanh.yaml": "_target_: ext_model.TanhNet\nin_features: ${data.dim}\n",
}


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """The user's directory: four Python files and four YAML files, importable and searchable."""
    root = tmp_path_factory.mktemp("my_lab")
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        yield root, f"hydra.searchpath=[file://{root / 'conf'}]"


def _repository_state() -> str:
    """What git sees changed in the repository (tracked files, and new files it does not ignore)."""
    status = ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"]
    return subprocess.run(status, capture_output=True, text=True, check=True).stdout


def test_a_sweep_with_the_new_loss_gather_data_and_model(extension, tmp_path):
    _, searchpath = extension
    before = _repository_state()
    sweep = tmp_path / "sweep"
    result = run_command(
        "train", "-m", searchpath, "model=tanh", "data=rings", "loss=ntxent,align_uniform",
        "gather=padded_sum,old", "layout=cpu1,cpu2", "global_batch_size=16", "steps=8",
        "optim.lr=0.1", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = pd.read_csv(sweep / "comparison.csv")
    verdicts = {(r.loss, r.gather, r.devices): r.verdict for r in table.itertuples()}
    for loss in ("ntxent", "align_uniform"):
        assert verdicts[loss, "padded_sum", 2] == "matches"  # an exact gather
        assert verdicts[loss, "old", 2] == "differs"  # the original bug
    exact = table[(table.gather == "padded_sum") & (table.devices == 2)]
    assert (exact.max_abs_loss_diff <= 1e-10).all() and (exact.max_abs_param_diff <= 1e-10).all()
    matrix = (sweep / "loss_matrix.md").read_text()
    assert "| `align_uniform` | invariant | ✓" in matrix
    assert (sweep / "loss_matrix.png").stat().st_size > 0
    assert _repository_state() == before


def test_the_audit_measures_the_new_gather_against_its_prediction(extension, tmp_path):
    _, searchpath = extension
    result = run_command(
        "audit", "--out", str(tmp_path / "audit"), searchpath, "audit.world_sizes=[2]",
        "+loss@audit.losses.align_uniform=align_uniform",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = pd.read_csv(tmp_path / "audit" / "audit.csv")
    mine = table[table.gather == "padded_sum"]
    assert set(mine["loss"]) == {"ntxent", "ntxent_global", "vicreg", "align_uniform"}
    assert (mine["predicted"] == "exact").all() and (mine["measured"] == "exact").all()
    aligned = table[table["loss"] == "align_uniform"].set_index("gather")
    assert aligned.loc["old", "style"] == "global"
    assert aligned.loc["old", "measured"] == aligned.loc["old", "predicted"] == "1/W"
    assert "`padded_sum`" in (tmp_path / "audit" / "audit.md").read_text()
