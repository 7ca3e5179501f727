"""The values a selection's indices pick, so that the build's check can tell a near tie from a
wrong index.

A max pooling, `max(dim)`, `argmax`, `topk` or `sort` returns indices, and the check compares
integers exactly. But ORT's convolution rounds differently from torch's, so two inputs of a
pooling window that differ by a rounding can come out in the other order: ORT picks one, torch
the other (a VGG's pooling after BatchNorm and ReLU did, and the model ran in parts for it).
Both picks are right within rounding, as the float results they come with are. So where the
indices differ, the check compares the values they pick from torch's input instead, within the
float tolerance; a wrong index picks a value that is not the maximum and still fails.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

aten = torch.ops.aten

# Selections whose indices count positions in the input's last 2 or 3 dimensions, flattened.
_POOLINGS = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool3d.default: 3,
}
# Selections along one dimension (argument 1 or `dim`, or every element where it is None),
# returning (values, indices).
_ALONG_DIM = {aten.max.dim, aten.min.dim, aten.topk.default, aten.sort.default,
              aten.sort.stable, aten.kthvalue.default, aten.mode.default}
# Selections along one dimension returning the indices alone.
_INDICES_ALONE = {aten.argmax.default, aten.argmin.default}
# Where each op takes its dimension, and its default.
_DIM_ARGUMENT = {aten.topk.default: (2, -1), aten.kthvalue.default: (2, -1),
                 aten.sort.stable: (None, -1)}

Picker = Callable[[torch.Tensor], torch.Tensor]


def selection(node: fx.Node) -> fx.Node | None:
    """The selection whose indices `node` is (its getitem of them, or an argmax), or None."""
    if node.target is operator.getitem and node.args[1] == 1:
        chosen = node.args[0]
        if isinstance(chosen, fx.Node) and chosen.target in (*_POOLINGS, *_ALONG_DIM):
            return chosen
        return None
    return node if node.target in _INDICES_ALONE else None


def picker(chosen: fx.Node, source: torch.Tensor) -> Picker:
    """A function from indices of `chosen` (a node `selection` returned) to the values of its
    input `source` at them, in the indices' shape."""
    target = chosen.target
    if target in _POOLINGS:
        flat = source.flatten(-_POOLINGS[target])
        return lambda indices: flat.gather(
            -1, indices.flatten(-_POOLINGS[target])).view(indices.shape)
    index, default = _DIM_ARGUMENT.get(target, (1, None if target in _INDICES_ALONE else -1))
    dim = chosen.kwargs.get("dim", default)
    if index is not None and len(chosen.args) > index:
        dim = chosen.args[index]
    if dim is None:
        return lambda indices: source.flatten()[indices]
    return lambda indices: source.gather(
        dim, indices if indices.dim() == source.dim() else indices.unsqueeze(dim),
    ).view(indices.shape)
