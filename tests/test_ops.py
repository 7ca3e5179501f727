"""Ops that real models use, each through ORT with eager's outputs and gradients.

Their backward ops either translate to ONNX, or are lowered at trace time into ops that do
(`capture/lowerings.py`: convolution_backward, plain and transposed; avg_pool2d_backward).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, assert_grads_equal, ran_through_ort

import lazygrad

OPS = {
    "max_pool": lambda h: F.max_pool2d(h, 2),
    "avg_pool": lambda h: F.avg_pool2d(h, 3, stride=2, padding=1, count_include_pad=False)
    .flatten(1) + F.avg_pool2d(h, 4).flatten(1).sum(-1, keepdim=True),
    "adaptive_avg_pool": lambda h: F.adaptive_avg_pool2d(h, (2, 3)),
    "upsample_nearest": lambda h: F.interpolate(h, scale_factor=2, mode="nearest"),
    "upsample_bilinear": lambda h: F.interpolate(h, scale_factor=2, mode="bilinear"),
    "einsum": lambda h: torch.einsum("bchw,bdhw->bcd", h, h),
    "max_min_reductions": lambda h: h.amax(dim=(2, 3)) + h.amin(-1).mean(-1) + h.max(1).values[
        :, :, 0
    ].sum(-1, keepdim=True),
    "group_norm": lambda h: F.group_norm(h, 2),
    "cross_entropy_label_smoothing": lambda h: F.cross_entropy(
        h.mean((2, 3)), torch.tensor([0, 3, 1]), label_smoothing=0.1
    ),
    "cross_entropy_ignore_index": lambda h: F.cross_entropy(
        h.flatten(2), torch.tensor([[0, -100] * 32, [1, 2] * 32, [-100, 3] * 32])
    ),
}


class ConvThen(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x))


class TransposedConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.grouped_up = torch.nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2)

    def forward(self, x):
        return self.grouped_up(torch.relu(self.up(x)))


def _model(name: str) -> torch.nn.Module:
    return TransposedConv() if name == "transposed_convolution" else ConvThen(OPS[name])


@pytest.mark.parametrize("name", [*OPS, "transposed_convolution"])
def test_op_runs_through_ort_with_eagers_outputs_and_gradients(name):
    torch.manual_seed(0)
    eager = _model(name)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(3, 3, 8, 8)
    for step in range(2):  # the first step runs eagerly and builds; the second runs in ORT
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        out, expected = lazy(x), eager(x)
        cotangent = torch.randn_like(expected)
        (out * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        assert_close(out.detach(), expected.detach(), f"{name} step {step} output")
        assert_grads_equal(lazy, eager, f"{name} step {step}")
    assert ran_through_ort([out])
    assert lazygrad.stats(lazy).fallbacks == 0
