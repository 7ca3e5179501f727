"""Stage 4, to ONNX: an ATen-level GraphModule -> a standard ONNX model, without a re-trace.

`torch.onnx.export(dynamo=True)` would trace the graph again with torch.export (9-12 s per mask
on the BERT-shaped model); here the AOT graph is wrapped in an ExportedProgram as it is and
handed to the exporter's translator (2-4 s). Symbolic sizes stay symbolic: the ONNX inputs get
named dynamic dimensions. Inputs are named after the graph's placeholders.
"""

from __future__ import annotations

import contextlib

import onnx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lazygrad.capture import complex_pairs, private, quiet
from lazygrad.capture.partition import output_node, placeholders
from lazygrad.capture.trace import in_float64, onnx_registry
from lazygrad.session import COMPLEX_OUTPUTS


def to_onnx(gm: fx.GraphModule) -> onnx.ModelProto:
    registry = onnx_registry()
    complex_pairs.as_real_pairs(gm, lambda op: any(
        translation.is_complex for translation in registry.get_decomps(op)))
    _numbers_as_tensors(gm)
    _strided_views_in_storage_order(gm)
    gm, constants = _lift_constants(gm)
    inputs = placeholders(gm)
    wide = in_float64(p.meta.get("val") for p in inputs if p.name not in constants)
    with quiet.ignoring(), private.fx_config.patch(backed_size_oblivious=True), \
            private.float64_numbers() if wide else contextlib.nullcontext():
        # Before the signature names the outputs: an output of float16 computed in float32
        # (a sum) gets its cast back here, and the signature must name the cast, not the sum.
        private.onnx_fx_passes.insert_type_promotion_nodes(gm)
        gm = private.onnx_fx_passes.remove_assertion_nodes(gm)
        outputs = list(output_node(gm).args[0])
        onnx_program = private.onnx_core._exported_program_to_onnx_program(
            _as_exported_program(gm, inputs, outputs, constants), registry=registry
        )
    # No onnxscript optimize(): its rewriter took 14 of 18 s per mask on the BERT-shaped model,
    # and ONNX Runtime's own graph optimisations (constant folding, fusions) run at load.
    model = onnx_program.model_proto
    _identity_transposes_dropped(model.graph)
    complex_outputs = [value.name for value, node in zip(model.graph.output, outputs)
                       if (dtype := _dtype(node)) is not None and dtype.is_complex]
    if complex_outputs:
        model.metadata_props.add(key=COMPLEX_OUTPUTS, value=",".join(complex_outputs))
    return model


def _as_exported_program(gm: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node],
                         constants: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """The AOT graph as the exporter's input, as it is: its placeholders the user inputs (or
    the lifted constants), its outputs the user outputs, its symbolic sizes' ranges."""
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
    return private.ExportedProgram(
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


def _numbers_as_tensors(gm: fx.GraphModule) -> None:
    """A Python number where an op's schema takes a Tensor becomes a 0-d tensor constant, in
    place, where the exporter would translate it otherwise than eager computes:

    - as the op's first argument: `torch.add(0.3333, mask, alpha=0.6667)` (PhiMoE's router
      gradient) traces as `add.Tensor(0.3333, mask)`; torch wraps the number into a tensor, the
      graph keeps the number, and the exporter finds no overload for it;
    - a float in an op that computes in float64: the exporter makes every number a float32
      constant cast to the op's type, so a float64 model computed with its constants (an
      epsilon, `1/N` in BatchNorm's backward, GELU's `1/sqrt(2)`) rounded to float32, 1e-9
      off where eager is 1e-16 off.

    The constant is float64 where the op computes in float64, else of the number's default
    dtype: a 0-d tensor promotes as the number does (it does not widen a tensor of its
    category)."""
    count = 0
    for node in list(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        wide = any(isinstance(arg, fx.Node) and _dtype(arg) == torch.float64
                   for arg in node.args)
        args = list(node.args)
        for index, (arg, declared) in enumerate(zip(args, schema.arguments)):
            if not isinstance(declared.type, torch.TensorType) \
                    or not isinstance(arg, (bool, int, float)) \
                    or not (index == 0 or (wide and isinstance(arg, float))):
                continue
            value = torch.tensor(arg, dtype=torch.float64 if wide and isinstance(arg, float)
                                 else None)
            attribute = f"_lazygrad_number_{count}"
            count += 1
            gm.register_buffer(attribute, value)
            with gm.graph.inserting_before(node):
                args[index] = gm.graph.get_attr(attribute)
            args[index].meta["val"] = value
        node.args = tuple(args)
    if count:
        gm.recompile()


def _strided_views_in_storage_order(gm: fx.GraphModule) -> None:
    """`as_strided` reads its input's storage, the exporter's translation its values in
    logical order from its first (torchlib: "non-contiguous views remain unsupported"): over
    a transposed tensor it read other elements (Longformer's chunked attention: the check
    refused the graph, and the attention ran eagerly). Where the input is a dense permutation
    of its storage and the view reads within it, the input is first laid out in storage order
    (a permute and a contiguous copy: the same in torch, a Transpose in ONNX) and the offset
    made relative to it, in place. Other inputs are left as they are (the check refuses what
    they compute otherwise)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.as_strided.default:
            continue
        source, size, stride = node.args[:3]
        value = source.meta.get("val") if isinstance(source, fx.Node) else None
        offset = node.args[3] if len(node.args) > 3 else None
        if not isinstance(value, torch.Tensor) or not _static(
                *value.shape, *value.stride(), value.storage_offset(), *size, *stride,
                *([] if offset is None else [offset])):
            continue
        start = value.storage_offset()
        offset = start if offset is None else offset
        if value.is_contiguous() and start == 0:
            continue
        order = sorted(range(value.dim()), key=lambda dim: -value.stride()[dim])
        end = offset + sum((length - 1) * step for length, step in zip(size, stride))
        if not _dense(value, order) or offset < start or end >= start + value.numel():
            continue
        with gm.graph.inserting_before(node):
            permuted = gm.graph.call_function(torch.ops.aten.permute.default, (source, order))
            laid_out = gm.graph.call_function(torch.ops.aten.clone.default, (permuted,),
                                              {"memory_format": torch.contiguous_format})
        permuted.meta["val"] = value.permute(order)
        laid_out.meta["val"] = permuted.meta["val"].contiguous()
        node.args = (laid_out, size, stride, offset - start)
        changed = True
    if changed:
        gm.recompile()


def _static(*values: object) -> bool:
    return all(isinstance(value, int) for value in values)


def _dense(value: torch.Tensor, order: list[int]) -> bool:
    """Whether `value`'s strides, in `order`, are a contiguous tensor's: its elements are a
    block of its storage, each once."""
    expected = 1
    for dim in reversed(order):
        if value.shape[dim] != 1 and value.stride()[dim] != expected:
            return False
        expected *= value.shape[dim]
    return True


def _identity_transposes_dropped(graph: onnx.GraphProto) -> None:
    """Transposes whose permutation keeps every dimension in place dropped, in place, their
    readers reading their input. torchlib's `index_put` moves the indexed dimensions first and
    back; where they are first already, as a picked-rows write (`ignored_rows.py`), both
    Transposes are identities, which ONNX Runtime runs as copies (one as large as a vocabulary
    head's logits took 4 ms alone, 13 in a profiled step). A graph output, which must be some
    node's output, keeps its Transpose."""
    outputs = {value.name for value in graph.output}
    renamed: dict[str, str] = {}
    kept = []
    for node in graph.node:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and perm \
                and perm == list(range(len(perm))) and node.output[0] not in outputs:
            renamed[node.output[0]] = renamed.get(node.input[0], node.input[0])
            continue
        _renamed_inputs(node, renamed)
        kept.append(node)
    if renamed:
        del graph.node[:]
        graph.node.extend(kept)
        shapes = [value for value in graph.value_info if value.name not in renamed]
        del graph.value_info[:]
        graph.value_info.extend(shapes)


def _renamed_inputs(node: onnx.NodeProto, renamed: dict[str, str]) -> None:
    """`node`'s inputs renamed, and those of its subgraphs' nodes (an If's branches read the
    outer graph's values by name)."""
    node.input[:] = [renamed.get(name, name) for name in node.input]
    for attribute in node.attribute:
        for subgraph in [*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])]:
            for inner in subgraph.node:
                _renamed_inputs(inner, renamed)
            for value in subgraph.output:
                value.name = renamed.get(value.name, value.name)


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


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
