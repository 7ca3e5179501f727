"""Stacked parameters and stacked gradients exchanged with ORT one slice at a time, uncopied.

An MoE layer keeps its experts' weights as one parameter [E, ...], which the grouped matmul
reads one slice at a time (`grouped_mm.py`: Gather(W, g), often through a Transpose of the last
two dimensions, as transformers hands its op `weight.transpose(-2, -1)`), and whose gradient it
makes one slice at a time, stacked (Concat along the first dimension of Unsqueeze(block, 0)).
ORT copies both ways: its GatherToSplitFusion turns the Gathers into a Split that copies every
expert's weight before its product, in the forward and again in the backward, and the Concat
copies every block of the gradient into the stack. On a Hugging Face Mixtral of hidden 512, 8
experts of 1024 and 2 layers (4 x 64 tokens), ORT's profile put 18 ms of the step in the Splits
and 38 ms in the Concats, against 102 ms in all the products.

A slice along the first dimension of a contiguous tensor is contiguous itself, so torch can hand
ORT each slice as an input of its own (an OrtValue over the parameter's memory, made once: the
optimizer updates it in place), and ORT can write each block of a gradient straight into its
slice of one tensor torch allocates (an IOBinding's preallocated outputs). This rewrites a graph
for that, before its session is made (session.py binds the names it lists): each Gather of a
slice of a state input reads a new input, the slice, through the same Transposes on its last
dimensions; each stacked output becomes its blocks, outputs of their own. The values and their
order of computation are the graph's own; only where they live changes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection

import onnx
import onnx.helper
import torch

from lazygrad.capture.node_order import attribute, is_standard, node_inputs, static_shape
from lazygrad.capture.onnx_constants import scalar_constants
from lazygrad.capture.stacked_products import stacked_block, zero_constants

_INTEGERS = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)

# The element types of the outputs sliced (gradients), and the dtype torch allocates them in.
TORCH_DTYPES = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
                onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A graph input or output exchanged as its slices along the first dimension."""

    name: str  # as the caller feeds or receives it
    slices: tuple[tuple[int, str], ...]  # (index along the first dimension, the graph's name)
    shape: tuple[int, ...]  # the whole tensor's
    elem_type: int  # onnx.TensorProto's code


def sliced(
    model: onnx.ModelProto, state: Collection[str]
) -> tuple[onnx.ModelProto, list[Stacked], list[Stacked]]:
    """A copy of `model` where slices are exchanged, the inputs among `state` fed as slices too
    (the whole stays an input: other nodes may read it), and the outputs returned as slices
    only."""
    model = _copy(model)
    graph = model.graph
    inputs = _sliced_inputs(graph, state)
    outputs = _sliced_outputs(graph)
    return model, inputs, outputs


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def _slice_type(name: str, elem_type: int, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, elem_type, list(shape[1:]))


def _sliced_inputs(graph: onnx.GraphProto, state: Collection[str]) -> list[Stacked]:
    """Each Gather(axis 0) of a constant index from a state input, or from Transposes of it that
    keep its first dimension, reads that slice as an input of its own instead."""
    reads: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node_inputs(node):
            reads[name].append(node)
    constants = scalar_constants(graph)
    taken = {value.name for value in (*graph.input, *graph.output, *graph.value_info)}
    taken.update(name for node in graph.node for name in node.output)
    replaced: dict[int, onnx.NodeProto] = {}  # id of a Gather -> what reads its slice instead
    walked: list[onnx.NodeProto] = []  # Transposes on the way, dropped where left unread
    stacked = []
    for value in list(graph.input):  # slices are added to it
        shape = static_shape(value)
        if value.name not in state or shape is None or len(shape) < 2 or shape[0] < 2:
            continue
        slices: dict[int, str] = {}
        gathers, transposes = _gathers(value.name, len(shape), reads, constants)
        for gather, index, perm in gathers:
            if not -shape[0] <= index < shape[0]:
                continue  # ORT's error stays
            g = index % shape[0]
            if g not in slices:
                slices[g] = _fresh_name(f"{value.name}.{g}", taken)
            slice_perm = [axis - 1 for axis in perm[1:]]
            if slice_perm == sorted(slice_perm):
                made = onnx.helper.make_node("Identity", [slices[g]], list(gather.output))
            else:
                made = onnx.helper.make_node(
                    "Transpose", [slices[g]], list(gather.output), perm=slice_perm)
            replaced[id(gather)] = made
        if not slices:
            continue
        walked.extend(transposes)
        elem_type = value.type.tensor_type.elem_type
        graph.input.extend(_slice_type(name, elem_type, shape) for name in slices.values())
        stacked.append(Stacked(value.name, tuple(sorted(slices.items())), shape, elem_type))
    if replaced:
        nodes = [replaced.get(id(node), node) for node in graph.node]
        del graph.node[:]
        graph.node.extend(_without_unread(nodes, graph, {id(node) for node in walked}))
    return stacked


def _gathers(
    name: str, rank: int, reads: dict[str, list[onnx.NodeProto]], constants: dict
) -> tuple[list[tuple[onnx.NodeProto, int, list[int]]], list[onnx.NodeProto]]:
    """(Gather, index, permutation of the input's dimensions on the way) for each Gather of one
    slice along the first dimension of `name`, directly or through Transposes that keep that
    dimension first; and those Transposes."""
    found, transposes = [], []
    frontier = [(name, list(range(rank)))]
    while frontier:
        value, perm = frontier.pop()
        for node in reads.get(value, ()):
            if node.input[0] != value:
                continue
            if is_standard(node, "Gather") and attribute(node, "axis", 0) == 0:
                index = constants.get(node.input[1])
                if index is not None and index.rank == 0 and index.data_type in _INTEGERS:
                    found.append((node, int(index.value), perm))
            elif is_standard(node, "Transpose"):
                step = attribute(node, "perm")
                if step and step[0] == 0:
                    transposes.append(node)
                    frontier.append((node.output[0], [perm[axis] for axis in step]))
    return found, transposes


def _without_unread(
    nodes: list[onnx.NodeProto], graph: onnx.GraphProto, droppable: set[int]
) -> list[onnx.NodeProto]:
    """`nodes` less those of `droppable` whose outputs nothing reads any more."""
    outputs = {value.name for value in graph.output}
    while True:
        read = collections.Counter(name for node in nodes for name in node_inputs(node))
        kept = [node for node in nodes if id(node) not in droppable
                or any(read[name] or name in outputs for name in node.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def _sliced_outputs(graph: onnx.GraphProto) -> list[Stacked]:
    """Each output that is a Concat along the first dimension of Unsqueeze(block, 0), one block
    per slice of a static shape, becomes its blocks, outputs of their own."""
    made_by = {name: node for node in graph.node for name in node.output}
    reads = collections.Counter(name for node in graph.node for name in node_inputs(node))
    reads.update(value.name for value in graph.output)
    inputs = {value.name for value in (*graph.input, *graph.initializer)}
    zeros = zero_constants(graph)
    dropped: set[int] = set()
    outputs: list[onnx.ValueInfoProto] = []
    stacked = []
    for value in graph.output:
        blocks = _blocks(value, made_by, reads, inputs, zeros)
        if blocks is None:
            outputs.append(value)
            continue
        shape = static_shape(value)
        elem_type = value.type.tensor_type.elem_type
        stack = made_by[value.name]
        dropped.add(id(stack))
        dropped.update(id(made_by[name]) for name in stack.input)
        outputs.extend(_slice_type(block, elem_type, shape) for block in blocks)
        stacked.append(Stacked(value.name, tuple(enumerate(blocks)), shape, elem_type))
    if stacked:
        nodes = [node for node in graph.node if id(node) not in dropped]
        del graph.node[:]
        graph.node.extend(nodes)
        del graph.output[:]
        graph.output.extend(outputs)
        gone = {entry.name for entry in stacked}
        kept = [value for value in graph.value_info if value.name not in gone]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    return stacked


def _blocks(
    value: onnx.ValueInfoProto, made_by: dict, reads: collections.Counter, inputs: set[str],
    zeros: set[str],
) -> list[str] | None:
    """The blocks `value` stacks, one per slice of its static shape, each made by a node of
    its own and read by nothing else; else None."""
    stack = made_by.get(value.name)
    shape = static_shape(value)
    if not is_standard(stack, "Concat") or attribute(stack, "axis") != 0 or shape is None \
            or value.type.tensor_type.elem_type not in TORCH_DTYPES \
            or len(shape) < 2 or len(stack.input) != shape[0] or reads[value.name] != 1:
        return None
    blocks = []
    for name in stack.input:
        block = stacked_block(name, made_by, reads, zeros)
        if block is None or block in inputs or block not in made_by or reads[block] != 1:
            return None
        blocks.append(block)
    return blocks if len(set(blocks)) == len(blocks) else None


def _fresh_name(wanted: str, taken: set[str]) -> str:
    name, count = wanted, 0
    while name in taken:
        count += 1
        name = f"{wanted}_{count}"
    taken.add(name)
    return name
