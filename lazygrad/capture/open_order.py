"""Top-k picks whose order eager's kernel chooses: noted by the trace, found in its graphs, and
rotated by the build's check to prove that no output or gradient depends on their order.

`topk(sorted=False)` returns, in eager, the order its CPU kernel's selection leaves (sorted only
for one pick, or at most 1/64 of the dimension). ONNX Runtime's TopK returns them sorted, and no
graph reproduces the kernel's order, so the trace takes the sorted top-k (`lowerings.sorted_topk`)
and notes it here. That is exact where the order does not matter (a router's picks gathered and
scattered back by the same indices) and wrong where it does (Informer's attention applies its
Dropout mask to the picks in their order: a decoder layer trained through ORT 0.18 off eager's
gradients). So the check (`verify.py`) runs the FX graphs again with each noted top-k's picks
rotated, and refuses the graphs if anything they return changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import fx

_noted = threading.local()


@contextlib.contextmanager
def noting() -> Iterator[list]:
    """Inside: the trace's open-order top-k's (their results and dimension) are noted, on this
    thread, into the list yielded."""
    noted: list = []
    previous = getattr(_noted, "picks", None)
    _noted.picks = noted
    try:
        yield noted
    finally:
        _noted.picks = previous


def note(picks: tuple[torch.Tensor, torch.Tensor], dim: int) -> None:
    """Note a traced top-k's (values, indices) as open-order (inside `noting`: every trace is,
    `capture`)."""
    noted = getattr(_noted, "picks", None)
    assert noted is not None, "an open-order top-k traced outside `open_order.noting`"
    noted.append((picks, dim))


def found(gm: fx.GraphModule | None, noted: list) -> dict[str, int]:
    """The top-k nodes of `gm` that may be noted ones, by name, with their dimension: those whose
    picks have a noted pick's shapes and dtypes. (The graph's tensors are not the ones the trace
    saw; a sorted top-k of the same sizes is rotated by the check too, which can only refuse
    more.)"""
    if gm is None:
        return {}
    dims = {_key(picks): dim for picks, dim in noted}
    nodes = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.target is torch.ops.aten.topk.default and isinstance(value, (tuple, list)):
            dim = dims.get(_key(value))
            if dim is not None:
                nodes[node.name] = dim
    return nodes


def _key(picks: Sequence[torch.Tensor]) -> tuple:
    return tuple((str(tensor.shape), tensor.dtype) for tensor in picks)


def rotated(picks: tuple[torch.Tensor, torch.Tensor], dim: int) -> tuple:
    """The picks in another order: each moved one place along `dim`."""
    return tuple(torch.roll(tensor, 1, dim) for tensor in picks)
