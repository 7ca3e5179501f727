"""Segment, after to_onnx: one backward ONNX graph -> a few graphs run in order, upper blocks first.

One ORT run of the whole backward holds every stashed tensor until it returns; eager autograd
frees each saved tensor as its backward passes the node. Run as segments, the stash a segment
reads last is dropped as soon as that segment returns. The cuts come from the graph alone:

- the nodes are put in an order where a node whose outputs are about as large as the inputs it
  is the last to read (a view, a copy, a cast) runs next to its first consumer, so that a stashed
  tensor is not turned into a copy that crosses the cut in its place; a node that shrinks its
  inputs (a weight gradient's matmul) stays where it is, so they are freed early;
- with that order, each cut is placed where the stash read by no later node reaches its share
  (1/count, 2/count, ...), at the point nearby where the tensors crossing the cut are smallest.

Sizes are estimated at the trace's example sizes (`env`); any size gives the same gradients.
Each segment is extracted by `onnx.utils.Extractor` from the reordered graph.
"""

from __future__ import annotations

import onnx
import onnx.shape_inference
import onnx.utils

from lazygrad.capture import symbols
from lazygrad.capture.node_order import node_inputs

# A cut may move this far (a fraction of the stash) from its ideal point to cross less.
_WINDOW = 0.25
# Each segment frees at least this much of the stash (bytes, at the example sizes): a smaller
# stash is not cut, a larger one into at most one segment per this much. A segment is one more
# ORT run (tens of microseconds); what it frees is held until the segment ends, above eager's
# peak, which frees each saved tensor as its node passes.
STASH_PER_SEGMENT = 16 * 2**20


def split(
    model: onnx.ModelProto, releasable: set[str], count: int, env: dict[str, int]
) -> list[onnx.ModelProto]:
    """The segments of `model`, in run order ([] if it does not split: run it whole).

    `releasable`: the graph inputs the caller can free once no later segment reads them (the
    stash); `env`: example values of the size symbols, to weigh tensors."""
    if count <= 1 or not releasable:
        return []
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    size = _Sizes(inferred, env)
    count = min(count, sum(map(size, releasable)) // STASH_PER_SEGMENT)
    if count <= 1:
        return []
    _constants_as_initializers(graph)
    constants = {t.name for t in graph.initializer}
    nodes = _late_order(list(graph.node), size, constants)
    cuts = _cuts(nodes, releasable, count, size)
    if not cuts:
        return []
    del graph.node[:]
    graph.node.extend(nodes)
    extractor = onnx.utils.Extractor(inferred)
    wanted = {value.name for value in graph.output}
    bounds = [0, *cuts, len(nodes)]
    later_reads: set[str] = set(wanted)
    spans = []
    for start, stop in reversed(list(zip(bounds, bounds[1:]))):
        span = nodes[start:stop]
        made = {name for node in span for name in node.output if name}
        read = {name for node in span for name in node_inputs(node) if name and name not in made}
        outputs = sorted(made & later_reads)
        spans.append((sorted(read - constants), outputs))
        later_reads = (later_reads - made) | read
    segments = [extractor.extract_model(inputs, outputs) for inputs, outputs in reversed(spans)]
    for segment in segments:  # what the session reads of its outputs (complex ones)
        segment.metadata_props.extend(model.metadata_props)
    return segments


def _constants_as_initializers(graph: onnx.GraphProto) -> None:
    """The graph's Constant nodes (of a tensor value) made initializers, in place: each segment
    then holds the constants it reads, where a Constant node's value crossed a cut as an input
    (and, read as an input, was no longer a constant to what looks for one: zero_where.py)."""
    outputs = {value.name for value in graph.output}  # made by the segment that returns them
    nodes = []
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None) \
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") \
            and node.output[0] not in outputs else None
        if value is None:
            nodes.append(node)
            continue
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
    del graph.node[:]
    graph.node.extend(nodes)


class _Sizes:
    """Bytes of each value at the example sizes; a size the graph does not name (an unknown
    dimension) counts as the largest example size, so that no cut is placed across it blindly."""

    def __init__(self, model: onnx.ModelProto, env: dict[str, int]) -> None:
        graph = model.graph
        self._types = {
            value.name: value.type.tensor_type
            for value in [*graph.value_info, *graph.input, *graph.output]
        }
        self._env = env
        self._large = max(env.values(), default=1)
        self._found: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        found = self._found.get(name)
        if found is None:
            found = self._found[name] = self._bytes(name)
        return found

    def _bytes(self, name: str) -> int:
        kind = self._types.get(name)
        if kind is None or not kind.HasField("shape"):
            return self._large
        count = 1
        for dim in kind.shape.dim:
            if dim.HasField("dim_value"):
                count *= dim.dim_value
            else:
                try:
                    count *= int(symbols.evaluate(dim.dim_param, self._env))
                except (NameError, SyntaxError):  # an unnamed dimension ("unk__3")
                    count *= self._large
        item = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).itemsize if kind.elem_type \
            else 4
        return count * item


def _late_order(
    nodes: list[onnx.NodeProto], size: _Sizes, constants: set[str]
) -> list[onnx.NodeProto]:
    """A topological order in which a node that does not shrink what it frees runs right
    before its first consumer (each node keeps its place otherwise)."""
    last_reader: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node_inputs(node):
            if name:
                last_reader[name] = index
                consumers.setdefault(name, []).append(index)
    # key >= own index, and <= each consumer's key: sorting by (key, index) stays topological.
    key = list(range(len(nodes)))
    for index in reversed(range(len(nodes))):
        node = nodes[index]
        after = [key[c] for name in node.output if name for c in consumers.get(name, ())]
        if not after:
            continue
        made = sum(size(name) for name in node.output if name)
        freed = sum(size(name) for name in set(node_inputs(node))
                    if name and name not in constants and last_reader[name] == index)
        if 2 * made >= freed:
            key[index] = min(after)
    order = sorted(range(len(nodes)), key=lambda index: (key[index], index))
    return [nodes[index] for index in order]


def _cuts(
    nodes: list[onnx.NodeProto], releasable: set[str], count: int, size: _Sizes
) -> list[int]:
    """Node positions to cut before: one per share of the stash released, where the tensors
    crossing the cut are smallest nearby (none where the stash is not released gradually)."""
    length = len(nodes)
    last_reader: dict[str, int] = {}
    made_at: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node_inputs(node):
            if name:
                last_reader[name] = index
        for name in node.output:
            if name:
                made_at[name] = index
    # released[c]: stash no node at or after c reads; crossing[c]: made before c, read at or
    # after c (difference arrays, summed below).
    released = [0] * (length + 2)
    crossing = [0] * (length + 2)
    for name in releasable & last_reader.keys():
        released[last_reader[name] + 1] += size(name)
    for name, at in made_at.items():
        end = last_reader.get(name, -1)
        if end > at:
            crossing[at + 1] += size(name)
            crossing[end + 1] -= size(name)
    running_released = running_crossing = 0
    points = []
    for cut in range(length + 1):
        running_released += released[cut]
        running_crossing += crossing[cut]
        points.append((running_released, running_crossing))
    total = points[-1][0]
    if total == 0:
        return []
    cuts: list[int] = []
    for share in range(1, count):
        target = total * share / count
        window = total * _WINDOW / count
        start = cuts[-1] + 1 if cuts else 1
        near = [c for c in range(start, length) if abs(points[c][0] - target) <= window]
        if near:
            cuts.append(min(near, key=lambda c: (points[c][1], abs(points[c][0] - target))))
    return cuts
