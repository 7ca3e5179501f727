"""The workloads of issue #4: what is trained, on which inputs, with which loss at which step.

A workload is plain data plus three functions, so the same definition serves the interleaved run
in this process and the fresh-process runs that measure memory and the first step.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lazygrad.examples.models import (
    BertConfig,
    BertPretraining,
    MoELayer,
    ResNet18,
    RoutedExperts,
    bert_batch,
)

BERT = BertConfig(vocab=8000, hidden=256, layers=4, heads=4, max_positions=256)
BERT_BATCH, BERT_SEQ = 8, 128
MOE_HIDDEN, MOE_EXPERTS, MOE_SHAPE = 128, 4, (4, 32, 128)
AUX_EVERY = 4

Outputs = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One row group of the report."""

    name: str
    model: Callable[[], nn.Module]  # a fresh model, the same weights every time
    inputs: Callable[[int], tuple]  # step index -> model inputs
    loss: Callable[[Outputs, int], torch.Tensor]  # outputs, step index -> the loss to backward
    settle: int  # steps until every cache a peer fills in steady state is filled
    cycle: int  # steps after which the sequence of grad masks and inputs repeats
    autocast: torch.dtype | None = None  # the forward under CPU autocast to this type

    def step(self, model: nn.Module) -> Callable[[int], None]:
        """One training step of `model` (zero grads, forward, loss, backward) by step index."""

        def run(index: int) -> None:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=self.autocast, enabled=self.autocast is not None):
                outputs = model(*self.inputs(index))
            self.loss(outputs, index).backward()

        return run


def _bert_model() -> nn.Module:
    torch.manual_seed(0)
    return BertPretraining(BERT)


@functools.cache
def _bert_inputs(seq: int) -> tuple[torch.Tensor, ...]:
    return bert_batch(BERT, batch=BERT_BATCH, seq=seq, seed=seq)


# Workload 1: the compositions of the BERT pre-training outputs a user backwards through.
COMPOSITIONS: dict[str, Callable[[Outputs], torch.Tensor]] = {
    "loss": lambda out: out[0],
    "loss + scores": lambda out: out[0] + out[1].mean(),
    "all three": lambda out: out[0] + out[1].mean() + out[2].mean(),
}


def bert(composition: str, autocast: torch.dtype | None = None) -> Workload:
    compose = COMPOSITIONS[composition]
    return Workload(
        name=f"bert {composition}" + (f", autocast {str(autocast)[6:]}" if autocast else ""),
        model=_bert_model,
        inputs=lambda index: _bert_inputs(BERT_SEQ),
        loss=lambda out, index: compose(out),
        # lazygrad: step 0 runs in eager PyTorch (or, on a model that ran another composition,
        # with the old mask's forward) and builds this mask's graphs at its backward; step 1 is
        # ORT's first run of them; step 2 on is steady.
        settle=3,
        cycle=1,
        autocast=autocast,
    )


def _moe_model() -> nn.Module:
    torch.manual_seed(0)
    return MoELayer(hidden=MOE_HIDDEN, experts=MOE_EXPERTS)


@functools.cache
def _moe_input() -> tuple[torch.Tensor]:
    return (torch.randn(*MOE_SHAPE, generator=torch.Generator().manual_seed(1)),)


def _moe_loss(out: Outputs, index: int) -> torch.Tensor:
    task = out[0].pow(2).mean()
    return task + 0.01 * out[1] if index % AUX_EVERY == AUX_EVERY - 1 else task


# Workload 2: the auxiliary loss joins every 4th step, so the grad mask changes under the cache.
MOE = Workload(
    name="moe aux every 4th",
    model=_moe_model,
    inputs=lambda index: _moe_input(),
    loss=_moe_loss,
    settle=2 * AUX_EVERY,  # every mask seen twice (the aux mask at steps 3 and 7)
    cycle=AUX_EVERY,
)


def _routed_model() -> nn.Module:
    torch.manual_seed(0)
    return RoutedExperts(hidden=MOE_HIDDEN, experts=MOE_EXPERTS)


@functools.cache
def _routed_input(which: int) -> tuple[torch.Tensor]:
    return (torch.randn(*MOE_SHAPE, generator=torch.Generator().manual_seed(100 + which)),)


# Token routing (each expert run on its own tokens): the counts of tokens per expert change at
# every step (8 batches in turn), and the auxiliary loss joins every 4th step.
ROUTED = Workload(
    name="moe token-routed",
    model=_routed_model,
    inputs=lambda index: _routed_input(index % 8),
    loss=_moe_loss,
    settle=2 * AUX_EVERY,
    cycle=8,
)


def _resnet_model() -> nn.Module:
    torch.manual_seed(0)
    return ResNet18(widths=(64, 128, 256, 512))


@functools.cache
def _resnet_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(8, 3, 112, 112, generator=generator),
            torch.randint(0, 10, (8,), generator=generator))


# A torchvision-style CNN: ResNet-18's layout and widths, 112 px images, batch 8, training mode
# (BatchNorm's batch statistics), cross-entropy over 10 classes.
RESNET = Workload(
    name="resnet18",
    model=_resnet_model,
    inputs=lambda index: _resnet_batch()[:1],
    loss=lambda out, index: F.cross_entropy(out, _resnet_batch()[1]),
    settle=2,
    cycle=1,
)


def seq_lengths(lengths: tuple[int, ...]) -> Workload:
    """Workload 3: workload 1's loss, each pass visiting every length once in a shuffled order."""

    def length(index: int) -> int:
        order = list(lengths)
        random.Random(index // len(lengths)).shuffle(order)
        return order[index % len(lengths)]

    return Workload(
        name=f"bert seq {min(lengths)}..{max(lengths)}",
        model=_bert_model,
        inputs=lambda index: _bert_inputs(length(index)),
        loss=lambda out, index: out[0],
        settle=0,
        cycle=len(lengths),
    )


# Workloads a fresh process can be asked to run, by name.
WORKLOADS: dict[str, Workload] = {w.name: w for w in [*(bert(c) for c in COMPOSITIONS), MOE,
                                                       ROUTED, RESNET,
                                                       bert("loss", torch.float16),
                                                       bert("loss", torch.bfloat16)]}
