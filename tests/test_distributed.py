"""DistributedDataParallel around a lazy model: two gloo processes on localhost, gradients equal to
eager DDP's."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lazygrad
from lazygrad.examples.models import ThreeHeadMLP

WORLD = 2
STEPS = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, results: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks (DDP also broadcasts them)
        model = ThreeHeadMLP()
        # find_unused_parameters: the loss composition (the grad mask) changes between steps.
        lazy = torch.nn.parallel.DistributedDataParallel(
            lazygrad.lazy(copy.deepcopy(model)), find_unused_parameters=True
        )
        eager = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), find_unused_parameters=True
        )
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (lazy, eager)]
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        record = []
        for step in range(STEPS):
            x = torch.randn(5, 16, generator=generator)
            grads, outputs = [], []
            for model_, optimizer in zip((lazy, eager), optimizers):
                optimizer.zero_grad(set_to_none=True)
                a, b, c = model_(x)
                loss = a.sum() + (b * b).mean() + (c.sum() if step % 2 else 0)
                loss.backward()
                grads.append({
                    n: None if p.grad is None else p.grad.clone()
                    for n, p in model_.module.named_parameters()
                })
                outputs.append(loss.detach())
                optimizer.step()
            record.append((outputs, grads))
        stats = lazygrad.stats(lazy.module)
        torch.save({"record": record, "fallbacks": stats.fallbacks}, f"{results}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_around_a_lazy_model_matches_eager_ddp_in_two_gloo_processes(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]
    for rank, result in enumerate(ranks):
        assert result["fallbacks"] == 0
        for step, ((lazy_loss, eager_loss), (lazy_grads, eager_grads)) in enumerate(
            result["record"]
        ):
            torch.testing.assert_close(lazy_loss, eager_loss, rtol=1e-5, atol=1e-6)
            for name, expected in eager_grads.items():
                if expected is None or lazy_grads[name] is None:
                    assert lazy_grads[name] is expected is None, f"rank {rank} step {step} {name}"
                    continue
                torch.testing.assert_close(
                    lazy_grads[name], expected, rtol=1e-5, atol=1e-6,
                    msg=lambda m, n=name, s=step, r=rank: f"rank {r} step {s} {n}: {m}",
                )
    # DDP averaged the gradients: both ranks hold the same ones although their data differ.
    for name, grad in ranks[0]["record"][-1][1][0].items():
        torch.testing.assert_close(ranks[1]["record"][-1][1][0][name], grad)
