"""Training through lazygrad reaches the same parameters as eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MODEL_CASES, relative_error

import lazygrad


@pytest.mark.parametrize("policy", ["predict", "recompute"])
def test_fifty_adam_steps_with_changing_loss_compositions_match_eager(policy):
    model, inputs = MODEL_CASES["bert"]()
    lazy = lazygrad.lazy(copy.deepcopy(model), policy=policy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, lazy)]
    losses = {id(model): [], id(lazy): []}
    for step in range(50):
        for m, opt in zip((model, lazy), opts):
            opt.zero_grad(set_to_none=True)
            loss, scores, nsp = m(*inputs)
            total = loss + (1e-3 * scores.square().mean() if step % 4 == 3 else 0)
            if step % 10 == 9:
                total = nsp.logsumexp(-1).mean()
            total.backward()
            opt.step()
            losses[id(m)].append(total.item())
    assert losses[id(model)][-1] < losses[id(model)][0]  # it did train
    for a, b in zip(losses[id(model)], losses[id(lazy)]):
        assert abs(a - b) <= 1e-4 * max(abs(a), 1.0)
    for (name, p), q in zip(lazy.named_parameters(), model.parameters()):
        assert relative_error(p.detach(), q.detach()) < 1e-4, name
    assert lazygrad.stats(lazy).builds <= 4
