"""The size benchmark's models (gatherlab.lab.sizemodels; docs/performance.md, "Checking and
recording at real sizes"): each has the parameters its architecture's count gives, about its
nominal size, and the benchmark's step is SimCLR's NT-Xent."""

from __future__ import annotations

import pytest
import torch

from gatherlab.check import defaults
from gatherlab.lab import sizemodels, sizes


def vit_parameters(dim: int, depth: int) -> int:
    # patches 3·8²·d + d, class token d, positions (4 + 1)·d; a block: two norms 4d, qkv 3d² + 3d,
    # its projection d² + d, the MLP 4d² + 4d + 4d² + d; the final norm 2d, the head 128·d + 128
    block = 12 * dim**2 + 13 * dim
    return depth * block + (192 + 1 + 1 + 5 + 2 + 128) * dim + 128


def resnet_parameters(width: int) -> int:
    def block(inputs: int, outputs: int, stride: int) -> int:
        count = 9 * inputs * outputs + 9 * outputs**2 + 4 * outputs  # two convs, two norms
        if stride != 1 or inputs != outputs:
            count += inputs * outputs + 2 * outputs  # the 1×1 shortcut and its norm
        return count

    widths = [width, 2 * width, 4 * width, 8 * width]
    count, inputs = 27 * width + 2 * width, width  # the stem's conv and norm
    for stage, outputs in enumerate(widths):
        count += block(inputs, outputs, 1 if stage == 0 else 2) + block(outputs, outputs, 1)
        inputs = outputs
    return count + (inputs**2 + inputs) + (inputs * 128 + 128)  # the head


COUNT = {
    "vit": lambda size: vit_parameters(**sizemodels.SIZES["vit"][size]),
    "resnet": lambda size: resnet_parameters(**sizemodels.SIZES["resnet"][size]),
}


@pytest.mark.parametrize("model", sizemodels.SIZES)
def test_each_model_has_its_architectures_parameters_near_its_nominal_size(model):
    for size in sizemodels.SIZES[model]:
        nominal = float(size.removesuffix("M")) * 1e6
        assert abs(COUNT[model](size) / nominal - 1) < 0.04, (model, size, COUNT[model](size))
    for size in ("1M",):  # built: the count is the code's
        assert sizemodels.parameters(sizemodels.build(model, size)) == COUNT[model](size)


def test_vit_b_is_86m_parameters():
    assert vit_parameters(768, 12) == 85_307_264


@pytest.mark.parametrize("model", sizemodels.SIZES)
def test_the_benchmarks_step_is_simclrs_nt_xent_of_both_views(model):
    # Without a process group the gather returns its input: the loss is NT-Xent (temperature
    # 0.5) of the 2N embeddings, row i's positive its other view, i ± N, computed here anew.
    torch.manual_seed(0)
    net = sizemodels.build(model, "1M").double()
    data = sizemodels.Views(4, sizemodels.IMAGE[model])
    views = (data.views[0].double(), data.views[1].double())
    loss = float(sizemodels.contrastive_step(net, views).detach())
    with torch.no_grad():
        z = torch.nn.functional.normalize(net(torch.cat(views)), dim=1)
    similarity = torch.exp(z @ z.T / 0.5)
    expected = 0.0
    for i in range(8):
        positive = similarity[i, (i + 4) % 8]
        expected -= float(torch.log(positive / (similarity[i].sum() - similarity[i, i]))) / 8
    assert loss == pytest.approx(expected, rel=1e-12)


def test_the_benchmark_measures_a_low_precision_both_ways_and_float64_once():
    # the default (auto) and the other mode: the float64 verdict where auto judges in floors
    # alone (at or above the threshold), floors alone below it
    threshold = defaults.FLOORS_ALONE_PARAMETERS
    assert sizes._modes("64-true", 10**9) == ("auto",)
    assert sizes._modes("32-true", threshold) == ("auto", "float64")
    assert sizes._modes("bf16-mixed", threshold - 1) == ("auto", "floors")
    assert sizes.PRECISIONS == ("64-true", "32-true", "bf16-mixed")
