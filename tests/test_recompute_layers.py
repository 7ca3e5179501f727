"""Layer-wise recomputation (`recompute_layers=True`): the layers found by structure, the stash
of layer inputs, and gradients that stay eager's for every mask."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    CheckpointedNet,
    all_masks,
    assert_close,
    assert_grads_equal,
    stash_step,
    stash_steps_like_eager,
)

import lazygrad
from lazygrad.capture.layers import repeated_layers
from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


class Stages(torch.nn.Module):
    """A ResNet's shape: a stem, two stages of repeated blocks (with BatchNorm), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.stage1 = torch.nn.Sequential(Block(8), Block(8))
        self.stage2 = torch.nn.Sequential(Block(8), Block(8), Block(8))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.stage2(self.stage1(self.stem(x))).mean((2, 3)))


def test_the_layers_are_the_repeated_composite_children_of_a_container():
    bert = BertPretraining(BertConfig(vocab=50, hidden=16, layers=3, heads=2))
    assert repeated_layers(bert) == ["layers.0", "layers.1", "layers.2"]
    assert repeated_layers(Stages()) == ["stage1.0", "stage1.1", "stage2.0", "stage2.1",
                                         "stage2.2"]
    # Single layers in a row are no layers (their outputs are what a stash of inputs keeps);
    # nor is a container's only child; a layer's own repeated parts go with it.
    assert repeated_layers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                               torch.nn.Linear(4, 4))) == []
    assert repeated_layers(torch.nn.ModuleList([Block(4)])) == []
    nested = torch.nn.ModuleList(torch.nn.ModuleList([Block(4), Block(4)]) for _ in range(2))
    assert repeated_layers(nested) == ["0", "1"]


def _three_steps_like_eager(checkpointed: bool, layers: bool, x: torch.Tensor
                            ) -> tuple[int, lazygrad.Stats]:
    """Three steps of a `CheckpointedNet` and its lazy copy (`recompute_layers=layers`), each
    step's output and gradients eager's: the bytes the lazy model's last step saved, and its
    statistics."""
    torch.manual_seed(0)
    eager = CheckpointedNet(checkpointed=checkpointed)
    lazy = lazygrad.lazy(copy.deepcopy(eager), recompute_layers=layers)
    steps = stash_steps_like_eager(lazy, eager, x, f"recompute_layers={layers}, ")
    return steps[-1][0], lazygrad.stats(lazy)


def test_the_stash_holds_what_enters_each_layer_and_training_stays_eagers():
    """Three residual blocks with Dropout: the forward keeps each layer's input and its
    Dropout draw (graph inputs, so the recomputation drops what the forward dropped) instead
    of every block's activations; outputs and gradients are eager's at every step, all
    through ORT."""
    x = torch.randn(16, 64, 32)
    activation = x.numel() * 4
    saved = {}
    for layers in (False, True):
        saved[layers], stats = _three_steps_like_eager(False, layers, x)
        assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0
    assert saved[False] > 20 * activation
    # each layer's input, the head's, and each layer's draw and mask
    assert saved[True] <= 4 * activation + 3 * 1.25 * activation


def test_a_model_that_checkpoints_its_own_layers_keeps_its_regions():
    """Layers the model already runs through `torch.utils.checkpoint` keep their regions:
    the same stash as without the option, eager's gradients."""
    x = torch.randn(16, 64, 32)
    saved = {}
    for layers in (False, True):
        saved[layers], stats = _three_steps_like_eager(True, layers, x)
        assert stats.fallbacks == 0
    assert saved[True] == saved[False]


@pytest.mark.parametrize("policy", ["predict", "all"])
def test_every_mask_trains_like_eager_with_a_smaller_stash(policy):
    """The BERT-shaped model, each of its grad masks in turn: outputs and gradients are
    eager's; the stash of each step through ORT is smaller than without the option (every
    output's backward runs through the layers)."""
    config = BertConfig(vocab=64, hidden=32, layers=3, heads=2)
    torch.manual_seed(0)
    eager = BertPretraining(config)
    ids, mlm_labels, nsp_labels = bert_batch(config, batch=4, seq=16)
    stashes = {}
    for layers in (False, True):
        lazy = lazygrad.lazy(copy.deepcopy(eager), policy=policy, recompute_layers=layers)
        for mask in all_masks(3):
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
            outputs = []
            for model in (lazy, eager):
                saved = [0]

                def pack(tensor, saved=saved):
                    saved[0] += tensor.numel() * tensor.element_size()
                    return tensor

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = model(ids, mlm_labels, nsp_labels)
                sum(o.float().mean() for o, bit in zip(out, mask) if bit).backward()
                outputs.append(out)
                if model is lazy:
                    stashes[layers, mask] = saved[0]
            for index, (got, want) in enumerate(zip(*outputs)):
                assert_close(got.detach(), want.detach(), f"mask {mask}: output {index}")
            assert_grads_equal(lazy, eager, f"recompute_layers={layers}, mask {mask}")
        assert lazygrad.stats(lazy).fallbacks == 0
    for mask in all_masks(3)[1:]:  # the first call runs in eager PyTorch
        assert stashes[True, mask] < stashes[False, mask], mask


def test_graphs_built_without_the_option_never_serve_a_model_with_it(private_disk_cache):
    """The disk index keys on the option: a model with `recompute_layers` builds its own
    graphs (an eager first step), and a second one with it is served by those."""
    x = torch.randn(4, 8, 32)
    torch.manual_seed(0)
    eager = CheckpointedNet(checkpointed=False).eval()  # no Dropout: one step is one call
    lazygrad_steps = []
    for layers in (False, True, True):
        lazy = lazygrad.lazy(copy.deepcopy(eager), recompute_layers=layers)
        got, _ = stash_step(lazy, x)
        want, _ = stash_step(eager, x)
        assert_close(got, want, f"recompute_layers={layers}")
        assert_grads_equal(lazy, eager, f"recompute_layers={layers}")
        stats = lazygrad.stats(lazy)
        lazygrad_steps.append((stats.eager_steps, stats.disk_hits))
    assert lazygrad_steps == [(1, 0), (1, 0), (0, 1)]


def test_recompute_layers_must_be_a_bool():
    with pytest.raises(ValueError, match="recompute_layers must be True or False, got 1"):
        lazygrad.lazy(torch.nn.Linear(2, 2), recompute_layers=1)
