"""Small multi-output models of the shapes lazygrad is for; used by the demo, tests and benchmarks.

- `ThreeHeadMLP`: a shared trunk with three heads (multi-task).
- `BertPretraining`: embeddings, attention layers, LayerNorm, GELU, an MLM head tied to the
  embeddings and an NSP head; returns (loss, prediction_scores, seq_relationship_score).
- `MoELayer`: top-1 routed experts returning (out, aux_loss), the load-balancing loss.
- `RoutedExperts`: top-2 token routing, each expert run on its own tokens only (their count
  is data, another at every step), returning (out, aux_loss).
- `ResNet18`: torchvision's ResNet-18 layout (BasicBlocks, BatchNorm, max pooling), widths
  chosen by the caller; returns the logits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class ThreeHeadMLP(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(features, hidden), nn.Tanh())
        self.regress = nn.Linear(hidden, 1)
        self.classify = nn.Linear(hidden, 5)
        self.embed = nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.regress(h), self.classify(h), self.embed(h)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab: int = 1000
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    max_positions: int = 256
    dropout: float = 0.0


class SelfAttentionLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.norm1 = nn.LayerNorm(config.hidden)
        self.ff = nn.Sequential(
            nn.Linear(config.hidden, 4 * config.hidden),
            nn.GELU(),
            nn.Linear(4 * config.hidden, config.hidden),
        )
        self.norm2 = nn.LayerNorm(config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (hidden // self.heads) ** 0.5
        attention = self.dropout(scores.softmax(-1)) @ v
        x = self.norm1(x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden)))
        return self.norm2(x + self.dropout(self.ff(x)))


class BertPretraining(nn.Module):
    def __init__(self, config: BertConfig = BertConfig()) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab, config.hidden)
        self.position = nn.Embedding(config.max_positions, config.hidden)
        self.norm = nn.LayerNorm(config.hidden)
        self.layers = nn.ModuleList(SelfAttentionLayer(config) for _ in range(config.layers))
        self.transform = nn.Sequential(
            nn.Linear(config.hidden, config.hidden), nn.GELU(), nn.LayerNorm(config.hidden)
        )
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab))
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.nsp = nn.Linear(config.hidden, 2)
        for embedding in (self.word, self.position):
            nn.init.normal_(embedding.weight, std=0.02)  # as BERT does: logits start small

    def forward(
        self, ids: torch.Tensor, mlm_labels: torch.Tensor, nsp_labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.word(ids) + self.position(positions))
        for layer in self.layers:
            x = layer(x)
        prediction_scores = self.transform(x) @ self.word.weight.t() + self.decoder_bias
        seq_relationship_score = self.nsp(torch.tanh(self.pooler(x[:, 0])))
        loss = F.cross_entropy(
            prediction_scores.reshape(-1, prediction_scores.shape[-1]),
            mlm_labels.reshape(-1),
            ignore_index=-100,
        ) + F.cross_entropy(seq_relationship_score, nsp_labels)
        return loss, prediction_scores, seq_relationship_score


def bert_batch(
    config: BertConfig, batch: int = 4, seq: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, MLM labels (-100 where not masked) and NSP labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab, (batch, seq), generator=generator)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    mlm_labels = torch.where(masked, ids, torch.full_like(ids, -100))
    mlm_labels[:, 1] = ids[:, 1]  # at least one masked token per row
    nsp_labels = torch.randint(0, 2, (batch,), generator=generator)
    return ids, mlm_labels, nsp_labels


class MoELayer(nn.Module):
    """Top-1 routing over dense experts, with the Switch-Transformer load-balancing loss."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.experts_count = experts
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.router(x).softmax(-1)
        top_prob, top_index = probs.topk(1, dim=-1)
        top_prob, top_index = top_prob.squeeze(-1), top_index.squeeze(-1)
        routed = F.one_hot(top_index, self.experts_count).to(x.dtype)
        expert_out = torch.stack([expert(x) for expert in self.experts], -1)
        out = (expert_out * (routed * top_prob.unsqueeze(-1)).unsqueeze(-2)).sum(-1)
        fraction = routed.reshape(-1, self.experts_count).mean(0)
        mean_prob = probs.reshape(-1, self.experts_count).mean(0)
        aux_loss = self.experts_count * (fraction * mean_prob).sum()
        return out, aux_loss


class RoutedExperts(nn.Module):
    """A Mixture-of-Experts layer as LMs write it (Mixtral's loop over experts): top-2 routing,
    each expert run on its own tokens only (`torch.where` of the routing mask, `x[tokens]`),
    its results added back by `index_add_`, and the Switch Transformer's load-balancing loss."""

    def __init__(self, hidden: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        weights, chosen = probs.topk(2, dim=-1)
        out = torch.zeros_like(tokens)
        routed = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for index, expert in enumerate(self.experts):
            slot, token = torch.where(routed[index])
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        share = F.one_hot(chosen[:, 0], len(self.experts)).float().mean(0)
        aux = len(self.experts) * (share * probs.mean(0)).sum()
        return out.reshape(x.shape), aux


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (downsampled by a strided
    1x1 convolution where the width or the resolution changes)."""

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = None
        if stride != 1 or inputs != width:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, width, 1, stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """Stem (7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max pooling), four stages of
    two BasicBlocks with strides 1, 2, 2, 2, adaptive average pooling, a linear classifier."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, inputs = [], widths[0]
        for width, stride in zip(widths, (1, 2, 2, 2)):
            stages.append(nn.Sequential(BasicBlock(inputs, width, stride),
                                        BasicBlock(width, width, 1)))
            inputs = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
