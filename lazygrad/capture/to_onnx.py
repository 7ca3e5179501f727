"""Stage 4, to ONNX: an ATen-level GraphModule -> a standard ONNX model, without a re-trace.

`torch.onnx.export(dynamo=True)` would trace the graph again with torch.export (9-12 s per mask
on the BERT-shaped model); here the AOT graph is wrapped in an ExportedProgram as it is and
handed to the exporter's translator (2-4 s). Symbolic sizes stay symbolic: the ONNX inputs get
named dynamic dimensions. Inputs are named after the graph's placeholders.
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings

import onnx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lazygrad.capture import private
from lazygrad.capture.partition import output_node, placeholders
from lazygrad.capture.trace import onnx_registry

# The exporter keeps state in module globals and warnings.catch_warnings swaps process-wide
# state: one export at a time, whatever the thread.
_lock = threading.Lock()


def to_onnx(gm: fx.GraphModule) -> onnx.ModelProto:
    _numbers_as_tensors(gm)
    gm, constants = _lift_constants(gm)
    inputs = placeholders(gm)
    outputs = list(output_node(gm).args[0])
    signature = private.ExportGraphSignature(
        input_specs=[
            private.InputSpec(
                kind=private.InputKind.CONSTANT_TENSOR,
                arg=private.TensorArgument(name=p.name),
                target=p.name,
            )
            if p.name in constants
            else private.InputSpec(
                kind=private.InputKind.USER_INPUT,
                arg=private.TensorArgument(name=p.name),
                target=None,
            )
            for p in inputs
        ],
        output_specs=[
            private.OutputSpec(
                kind=private.OutputKind.USER_OUTPUT,
                arg=private.TensorArgument(name=o.name),
                target=None,
            )
            for o in outputs
        ],
    )
    ranges = {}
    for node in inputs:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    env = size.node.shape_env
                    for symbol in size.node.expr.free_symbols:
                        ranges[symbol] = env.var_to_range.get(symbol)
    user_inputs = len(inputs) - len(constants)
    in_spec = pytree.tree_flatten(((tuple(range(user_inputs)),), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outputs))))[1]
    call_graph = [
        private.ModuleCallEntry(
            "",
            private.ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec),
        )
    ]
    program = private.ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict={},
        range_constraints=ranges,
        module_call_graph=call_graph,
        example_inputs=None,
        constants=constants,
        verifiers=None,
    )
    with _lock, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            private.fx_config.patch(backed_size_oblivious=True):
        warnings.simplefilter("ignore")
        module = program.graph_module
        private.onnx_fx_passes.insert_type_promotion_nodes(module)
        program._graph_module = private.onnx_fx_passes.remove_assertion_nodes(module)
        onnx_program = private.onnx_core._exported_program_to_onnx_program(
            program, registry=onnx_registry()
        )
    # No onnxscript optimize(): its rewriter took 14 of 18 s per mask on the BERT-shaped model,
    # and ONNX Runtime's own graph optimisations (constant folding, fusions) run at load.
    return onnx_program.model_proto


def _numbers_as_tensors(gm: fx.GraphModule) -> None:
    """A Python number as an op's first argument where its schema takes a Tensor becomes a 0-d
    tensor constant, in place.

    `torch.add(0.3333, mask, alpha=0.6667)` (PhiMoE's router gradient) traces as
    `add.Tensor(0.3333, mask)`: torch wraps the number into a tensor, the graph keeps the
    number, and the exporter finds no overload for it (as the second argument it translates
    it). A 0-d tensor of the number's default dtype promotes as the number does (a 0-d tensor
    does not widen a tensor of its category)."""
    count = 0
    for node in list(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not node.args \
                or not schema.arguments or not isinstance(schema.arguments[0].type,
                                                          torch.TensorType) \
                or not isinstance(node.args[0], (bool, int, float)):
            continue
        attribute = f"_lazygrad_number_{count}"
        count += 1
        gm.register_buffer(attribute, torch.tensor(node.args[0]))
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(attribute)
        constant.meta["val"] = getattr(gm, attribute)
        node.args = (constant, *node.args[1:])
    if count:
        gm.recompile()


def _lift_constants(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, torch.Tensor]]:
    """A copy of `gm` whose tensor constants (`torch.tensor(...)` in the forward: get_attr
    nodes) are lifted to leading placeholders, as an ExportedProgram holds them."""
    attributes = [
        n for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)
    ]
    if not attributes:
        return gm, {}
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    constants = {}
    for node in attributes:
        lifted = graph.placeholder(f"lifted_{node.name}")
        lifted.meta.update(node.meta)
        value = getattr(gm, node.target)
        if "val" not in lifted.meta:
            lifted.meta["val"] = value
        constants[lifted.name] = value
        mapping[node] = lifted
    graph.output(graph.graph_copy(gm.graph, mapping))
    return fx.GraphModule(gm, graph), constants
