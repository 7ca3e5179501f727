"""Gradients that sum rows into a table (an embedding's, `weight[expert_ids]`'s) are exact on
every run: ONNX Runtime's CPU ScatterND with reduction "add" runs on several threads without
guarding duplicate indices (onnxruntime#23396), and an accumulating index_put once came out
wrong by a few percent, differently from run to run, and sometimes passed the build's check."""

from __future__ import annotations

import copy

import torch
from conftest import ran_through_ort, squares_step_like_eager

import lazygrad


class GatheredExperts(torch.nn.Module):
    """transformers' `batched_mm` experts: each token's expert weights gathered by index."""

    def __init__(self, experts: int = 8, hidden: int = 64, inner: int = 128) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(0.05 * torch.randn(experts, inner, hidden))
        self.down = torch.nn.Parameter(0.05 * torch.randn(experts, hidden, inner))
        self.embed = torch.nn.Embedding(50, hidden)

    def forward(self, ids: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).reshape(-1, self.embed.embedding_dim)
        h = torch.bmm(self.up[expert_ids], x.unsqueeze(-1)).squeeze(-1).relu()
        return torch.bmm(self.down[expert_ids], h.unsqueeze(-1)).squeeze(-1)


def test_row_sums_with_many_duplicate_indices_equal_eager_on_every_run():
    torch.manual_seed(0)
    eager = GatheredExperts()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(0)
    for step in range(8):
        ids = torch.randint(0, 50, (8, 64), generator=generator)  # 512 tokens, 50 rows
        expert_ids = torch.randint(0, 8, (512,), generator=generator)  # 8 experts
        out = squares_step_like_eager(lazy, eager, (ids, expert_ids), f"step {step}")
        assert step == 0 or ran_through_ort([out])
    assert lazygrad.stats(lazy).fallbacks == 0
