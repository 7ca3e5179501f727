"""New nodes for a rewrite of a partitioned graph, with their values' metadata.

The rewrites after the partition (`ignored_rows.py`, `few_rows.py`, `broadcast_products.py`)
add ops the trace did not make; the stages after them (export, segmenting) read each node's
fake value, so a new node's value is computed on the graph's own fake tensors, under its shape
environment, where a size may be a symbol (a batch) or a number the graph computes (`nonzero`'s
count). A rewrite that fails half-way erases what it made: the graph stays as it was, never the
model in parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lazygrad.capture import private

aten = torch.ops.aten


def value_of(arg: Any) -> Any:
    """A node's fake value (None where the trace left none), or the argument itself."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


class Maker:
    """Makes nodes in `graph` on the fake tensors of `like`'s trace; `undo` erases them."""

    def __init__(self, graph: fx.Graph, like: fx.Node) -> None:
        self.graph = graph
        self.fake_mode = private.detect_fake_mode([value_of(like)])
        self.made: list[fx.Node] = []  # in the order made

    @property
    def counts_sizes(self) -> bool:
        """Whether a size the graph computes (`nonzero`'s count) can be made a symbol here."""
        return self.fake_mode is not None and self.fake_mode.shape_env is not None

    def __call__(self, before: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(before):
            made = self.graph.call_function(target, args, kwargs)
        self.made.append(made)
        with self.fake_mode, _without_autocast():
            made.meta["val"] = target(*pytree.tree_map(value_of, args),
                                      **pytree.tree_map(value_of, kwargs))
        if "custom" in before.meta:
            made.meta["custom"] = before.meta["custom"]
        return made

    def nonzero(self, before: fx.Node, condition: fx.Node) -> fx.Node:
        """The positions where the 1-D `condition` holds, as a vector: their count each call's."""
        picked = self(before, aten.nonzero.default, condition)
        bindings = private.compute_unbacked_bindings(self.fake_mode.shape_env, value_of(picked))
        if bindings:
            picked.meta["unbacked_bindings"] = bindings
        return self(before, aten.view.default, picked, [-1])

    def size(self, before: fx.Node, node: fx.Node, dim: int) -> Any:
        """`node`'s size `dim`: a number, or a node computing it where it is a symbol."""
        size = value_of(node).shape[dim]
        if isinstance(size, int):
            return size
        with self.graph.inserting_before(before):
            made = self.graph.call_function(aten.sym_size.int, (node, dim))
        self.made.append(made)
        made.meta["val"] = size
        return made

    def undo(self) -> None:
        """Erase what was made, the graph as it was (nothing else reads it yet)."""
        for node in reversed(self.made):
            self.graph.erase_node(node)


@contextlib.contextmanager
def _without_autocast() -> Iterator[None]:
    """Ops computed as written: the capture runs under the call's autocast (its trace records
    the casts), which would give a new product a float16 value here and a float32 one in ONNX
    (ORT refused such a graph: a position-bias table's gradient under autocast)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
