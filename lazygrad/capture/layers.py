"""Layer-wise recomputation (the `recompute_layers` option), before partition.

A deep model's stash is its layers' activations: every layer keeps what its backward reads (on
the 8-layer BERT-shaped workload B, 34 MiB a layer against a 2 MiB input). With this option the
forward keeps only what enters each layer, and the backward recomputes a layer's activations
just before that layer's backward runs, as activation checkpointing does and as ORTModule's
layer-wise recompute (memory optimization level 1) does: one more forward of each layer for a
stash of layer inputs.

The layers are found in the module tree, not by name: the children of a `ModuleList` or
`Sequential` that repeat (two or more of one class) and are made of several submodules with
parameters (a transformer's layers, a ResNet stage's blocks; not a `Sequential` of single
`Linear`s). Their ops in the joint graph (each node knows the submodule that emitted it,
`trace.module_paths`) are tagged as a checkpoint region is tagged
(`private.checkpoints_recomputed`), one region per layer, so AOTAutograd's partitioner saves
what enters each layer and puts the recomputation right before the layer's backward
(`reordering_to_mimic_autograd_engine`). A layer the model checkpoints itself keeps its own
regions. Recomputed ops are the forward's, on the same inputs (random draws are graph inputs,
`draws.py`), so gradients are unchanged.

Measured (`benchmarks/results/memory-targets.md`): workload B's whole-process peak 0.79-0.83x
eager's against 0.90-0.94x without the option; the steady step 13-17% slower.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Container, Iterator, Sequence

import torch
import torch.fx as fx

from lazygrad.capture import trace


def repeated_layers(module: torch.nn.Module) -> list[str]:
    """Qualified names of `module`'s layers (see the module's docstring), outermost only: a
    layer's own repeated parts are recomputed with it."""
    return list(_layers(module, ""))


def _layers(module: torch.nn.Module, prefix: str) -> Iterator[str]:
    children = list(module.named_children())
    chosen: set[str] = set()
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        classes = collections.Counter(type(child) for _, child in children)
        chosen = {name for name, child in children
                  if classes[type(child)] >= 2 and _composite(child)}
    for name, child in children:
        path = f"{prefix}.{name}" if prefix else name
        if name in chosen:
            yield path
        else:
            yield from _layers(child, path)


def _composite(module: torch.nn.Module) -> bool:
    """Made of two or more submodules with parameters of their own."""
    owners = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    return len(owners) >= 2


def tag_for_recompute(joint: fx.GraphModule, layers: Sequence[str]) -> None:
    """Tag the ops that each of `layers` emitted in `joint` and that do not read the backward's
    cotangents to be recomputed in the backward, one checkpoint region per layer (node meta
    "recompute" and "ac_graph_id"): its forward, and the parts of its backward that are
    functions of the forward's values alone (GELU's derivative; tagged, they are placed next to
    their use: untagged, workload B's peak was 25-30 MiB higher)."""
    if not layers:
        return
    policy = importlib.import_module("torch.utils.checkpoint").CheckpointPolicy
    # Region numbers above those the model's own checkpoints take (one per region it runs).
    offset = max((n.meta.get("ac_graph_id") or 0 for n in joint.graph.nodes), default=0)
    regions = {layer: offset + number for number, layer in enumerate(layers, start=1)}
    for node in joint.graph.nodes:  # a layer the model checkpoints itself is left as it is
        if node.meta.get("recompute") is not None:
            regions.pop(_layer(trace.submodule_of(node), regions), None)
    reads_cotangents: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                reads_cotangents.add(node)
            continue
        if any(arg in reads_cotangents for arg in node.all_input_nodes):
            reads_cotangents.add(node)
            continue
        layer = _layer(trace.submodule_of(node), regions)
        if node.op == "call_function" and layer is not None and _holds_tensors(node):
            node.meta["recompute"] = policy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = regions[layer]


def _layer(submodule: str, layers: Container[str]) -> str | None:
    """The one of `layers` that `submodule` (a qualified name) is, or is inside of."""
    while submodule:
        if submodule in layers:
            return submodule
        submodule = submodule.rpartition(".")[0]
    return None


def _holds_tensors(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return all(v is None or isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)
