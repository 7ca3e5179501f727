"""Stage 2, partition: the joint graph -> a forward graph and a backward graph.

AOTAutograd's default partitioner places each op where eager autograd runs it and saves what
the backward reads (the "predict" and "all" policies). The "recompute" policy saves nothing but
the inputs and random draws: its backward is the forward followed by the backward, in one graph.
With `recompute_layers`, the ops of the model's repeated layers are first tagged as checkpoint
regions (layers.py), so the partitioner saves what enters each layer and recomputes the rest.
Random ops are lifted out first (draws.py), so both graphs read the same draws as inputs, and
copies that keep their source's value and layout are dropped (copies.py), so a value is saved
once.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from lazygrad.capture import copies, layers, private
from lazygrad.capture import draws as random_draws
from lazygrad.capture.trace import Traced


@dataclasses.dataclass
class Partitioned:
    forward: fx.GraphModule  # primals, draws -> mutated inputs, outputs, saved tensors
    backward: fx.GraphModule | None  # saved tensors, tangents -> a gradient (or None) per primal
    draws: list[random_draws.Draw]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def rebuilt(gm: fx.GraphModule) -> None:
    """After a rewrite of `gm`'s graph: the nodes no one reads dropped, the graph checked, the
    module's code made again from it."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def replace_node(old: fx.Node, new: fx.Node) -> None:
    """Put the new node `new` in place of `old`, under `old`'s name: a backward placeholder
    names the forward node it reads (AOTAutograd's link between the two graphs, `tidy.py`), and
    a rewritten node the backward reads (a biased logits' matmul, saved for a GELU after it)
    lost its link (PatchTSMixer's graphs were refused: "KeyError: 'add_1'"). Names never
    freed by the graph stay unique: `old` is erased first, and no node took its name since."""
    name = old.name
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)
    new.name = name


def partition(
    traced: Traced, recompute: bool, recomputed_layers: Sequence[str] = ()
) -> Partitioned:
    """`recomputed_layers`: the submodules whose activations the backward recomputes
    (layers.py)."""
    draws = random_draws.lift(traced.joint)
    copies.drop_value_copies(traced.joint)
    if not traced.training:
        return Partitioned(traced.joint, None, draws)
    layers.tag_for_recompute(traced.joint, recomputed_layers)
    forward, backward = private.default_partition(
        traced.joint, None, num_fwd_outputs=traced.num_forward_outputs
    )
    if recompute:
        forward, backward = _recomputing(forward, backward, traced.num_forward_outputs)
    return Partitioned(forward, backward, draws)


def _recomputing(
    forward: fx.GraphModule, backward: fx.GraphModule, num_forward_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward without saved tensors; the backward recomputing them from the inputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in placeholders(forward):
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    tangents = {}
    for node in placeholders(backward):
        if node.name.startswith("tangents"):
            tangents[node] = graph.placeholder(node.name)
            tangents[node].meta.update(node.meta)
    forward_results = graph.graph_copy(forward.graph, env)
    produced = {
        node.name: value
        for node, value in zip(output_node(forward).args[0], forward_results)
        if isinstance(node, fx.Node)
    }
    backward_env = {
        node: tangents[node] if node in tangents else produced[node.name]
        for node in placeholders(backward)
    }
    graph.output(graph.graph_copy(backward.graph, backward_env))
    graph.eliminate_dead_code()
    # The recomputed forward reads the forward's tensor constants (get_attr), the rest reads
    # the backward's: the new module takes each from the graph that owns it.
    constants = {
        node.target: _attribute(forward, node.target) if _has_attribute(forward, node.target)
        else _attribute(backward, node.target)
        for node in graph.nodes if node.op == "get_attr"
    }
    recomputing = fx.GraphModule(constants, graph, class_name=type(backward).__name__)

    output = output_node(forward)
    output.args = (tuple(output.args[0][:num_forward_outputs]),)
    forward.graph.eliminate_dead_code()
    forward.recompile()
    return forward, recomputing


def _attribute(module: fx.GraphModule, target: str) -> Any:
    return operator.attrgetter(target)(module)


def _has_attribute(module: fx.GraphModule, target: str) -> bool:
    try:
        _attribute(module, target)
    except AttributeError:
        return False
    return True
