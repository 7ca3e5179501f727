"""The CUDA path: IOBinding on CUDA tensors, device index respected, torch's stream honoured.

Skipped where torch has no CUDA device or onnxruntime cannot load its CUDA provider.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MODEL_CASES, all_masks, assert_close, compose_loss, cuda_usable

import lazygrad

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_usable(), reason="needs CUDA and onnxruntime's CUDA provider"),
]


def _to(inputs: tuple, device: torch.device) -> tuple:
    return tuple(t.to(device) for t in inputs)


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_gradients_on_cuda_match_eager_cuda_for_every_mask(name):
    device = torch.device("cuda", 0)
    model, inputs = MODEL_CASES[name]()
    model = model.to(device)
    inputs = _to(inputs, device)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    count = len(model(*inputs))
    for mask in all_masks(count):
        for m in (model, lazy):
            m.zero_grad(set_to_none=True)
        outputs = lazy(*inputs)
        expected_outputs = model(*inputs)
        assert all(o.device == device for o in outputs)
        cotangents = [torch.randn_like(o) for o in outputs]
        compose_loss(outputs, mask, cotangents).backward()
        compose_loss(expected_outputs, mask, cotangents).backward()
        for got, want in zip(outputs, expected_outputs):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-4)
        for (pname, p), q in zip(lazy.named_parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None), pname
            if q.grad is not None:
                assert p.grad.device == device
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_device_index_of_the_inputs_is_respected():
    device = torch.device("cuda", 1)
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    lazy = lazygrad.lazy(copy.deepcopy(model).to(device))
    outputs = lazy(x.to(device))
    outputs[0].sum().backward()
    assert outputs[0].device == device and lazy.regress.weight.grad.device == device


def test_work_queued_on_a_side_stream_is_seen_by_ort():
    device = torch.device("cuda", 0)
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    model = model.to(device)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = torch.randn(4096, 16, device=device)
        scaled = big * 3.0 + 1.0  # queued on the side stream, maybe unfinished when ORT reads
        outputs = lazy(scaled)
        outputs[1].sum().backward()
    torch.cuda.synchronize()
    expected = model(scaled)
    assert_close(outputs[1].detach(), expected[1].detach(), "output on a side stream")


def test_cpu_and_cuda_calls_of_one_model_use_separate_graphs():
    model, (x,) = MODEL_CASES["three_head_mlp"]()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    lazy(x)[0].sum().backward()
    lazy.to("cuda")
    lazy.zero_grad(set_to_none=True)
    lazy(x.to("cuda"))[0].sum().backward()
    assert lazy.regress.weight.grad.is_cuda
    assert lazygrad.stats(lazy).exports == 2
