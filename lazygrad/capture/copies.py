"""Copies that keep a value and its layout, dropped from the joint graph before partitioning.

A traced function has copies eager never makes: `dropout(p=0)` in training decomposes to
`clone`, where eager returns its input. When both the copy and its source are read by the
backward (attention: the softmax output for softmax's derivative, its copy for the matmul with
V), the partitioner saves both, and the stash holds the same tensor twice (8 MiB a layer on the
8-layer model of benchmarks/memory.py). The joint graph is functional, so a copy with the same
strides is its source: readers of the copy read the source instead, and one tensor is saved.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from lazygrad.capture.views import VIEW_OPS


def drop_value_copies(joint: fx.GraphModule) -> int:
    """Point the readers of each layout-preserving copy at its source; returns how many copies
    were dropped. Kept: copies of graph inputs (a mutated input's old value may be what the copy
    holds), copies of views (a saved view is stashed as its base, maybe larger than the copy:
    tidy.py), copies the graph returns, and copies whose strides differ from their source's."""
    outputs = set(next(n for n in reversed(joint.graph.nodes) if n.op == "output").all_input_nodes)
    dropped = 0
    for node in list(joint.graph.nodes):
        if node.target is not torch.ops.aten.clone.default or node in outputs:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or source.op != "call_function" \
                or source.target in VIEW_OPS:
            continue
        if not _same_layout(node.meta.get("val"), source.meta.get("val")):
            continue
        node.replace_all_uses_with(source)
        joint.graph.erase_node(node)
        dropped += 1
    if dropped:
        joint.recompile()
    return dropped


def _same_layout(copy: object, source: object) -> bool:
    """The same shape, strides and dtype, symbol for symbol (no guard is added)."""
    if not isinstance(copy, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    return (copy.dtype == source.dtype and copy.device == source.device
            and _sizes(copy.shape) == _sizes(source.shape)
            and _sizes(copy.stride()) == _sizes(source.stride()))


def _sizes(values: tuple) -> tuple:
    return tuple(v.node.expr if isinstance(v, torch.SymInt) else v for v in values)
