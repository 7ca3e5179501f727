"""A Transpose of stacked products, made by the products themselves.

transformers' grouped-matmul experts (Mixtral's, OLMoE's default) hand their op each expert's
weight transposed (`weight.transpose(-2, -1)`), so the weight's gradient is the op's gradient,
one product per expert stacked (`grouped_mm.py`: Concat of Unsqueeze(MatMul)), then transposed
back to the parameter's layout: a Transpose that copied every expert's gradient each step (a
Mixtral of hidden 512 and 8 experts: 100 ms of its backward's 430 ms of kernels). A product's
transpose is the product of its operands the other way round, each transposed:
(A B)^T = B^T A^T, which ORT's FusedMatMul reads so (transA, transB). The same products, the
stack made in the parameter's layout.
"""

from __future__ import annotations

import collections

import onnx
import onnx.helper

from lazygrad.capture.node_order import (
    ORT_DOMAIN,
    attribute,
    import_ort_domain,
    is_standard,
    node_inputs,
)
from lazygrad.capture.onnx_constants import scalar_constants


def made_transposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (changed in place) where each Transpose(perm [0, 2, 1]) of a Concat along axis 0
    of Unsqueeze(axis 0) of 2-D products, each read by nothing else, is dropped and every
    product computes its transpose instead."""
    graph = model.graph
    made_by = {output: node for node in graph.node for output in node.output}
    reads = collections.Counter(name for node in graph.node for name in node_inputs(node))
    reads.update(value.name for value in graph.output)
    zeros = zero_constants(graph)
    swapped: dict[int, onnx.NodeProto] = {}  # id of a product -> its transposed form
    renamed: dict[str, str] = {}  # a stack -> the Transpose's output it becomes
    dropped: set[int] = set()
    reshaped: set[str] = set()  # values whose shapes change: their value_info goes
    for node in graph.node:
        if not is_standard(node, "Transpose") or attribute(node, "perm") != [0, 2, 1]:
            continue
        stack = made_by.get(node.input[0])
        if not is_standard(stack, "Concat") or attribute(stack, "axis") != 0 \
                or reads[stack.output[0]] != 1:
            continue
        products = [_product_under(name, made_by, reads, zeros) for name in stack.input]
        if not products or any(product is None for product in products):
            continue
        for product in products:
            swapped[id(product)] = _transposed(product)
            reshaped.add(product.output[0])
        reshaped.update([*stack.input, stack.output[0]])
        renamed[stack.output[0]] = node.output[0]
        dropped.add(id(node))
    if not renamed:
        return model
    nodes = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        node = swapped.get(id(node), node)
        node.output[:] = [renamed.get(name, name) for name in node.output]
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [value for value in graph.value_info if value.name not in reshaped]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    import_ort_domain(model)
    return model


def zero_constants(graph: onnx.GraphProto) -> set[str]:
    """The names of the graph's zero scalars (an Unsqueeze's axes [0] among them)."""
    return {name for name, scalar in scalar_constants(graph).items()
            if scalar.value == 0 and scalar.rank <= 1}


def stacked_block(name: str, made_by: dict, reads: collections.Counter, zeros: set[str]
                  ) -> str | None:
    """B where `name` = Unsqueeze(B, [0]), a block of a stack, read by the stack alone; else
    None."""
    unsqueeze = made_by.get(name)
    if not is_standard(unsqueeze, "Unsqueeze") or reads[name] != 1 \
            or len(unsqueeze.input) != 2 or unsqueeze.input[1] not in zeros:
        return None
    return unsqueeze.input[0]


def _product_under(name: str, made_by: dict, reads: collections.Counter, zeros: set[str]
                   ) -> onnx.NodeProto | None:
    """The product P of `name` = Unsqueeze(P, [0]), P 2-D (the stack is 3-D) and read by the
    Unsqueeze alone, which only the stack reads; else None."""
    block = stacked_block(name, made_by, reads, zeros)
    product = made_by.get(block) if block is not None else None
    if product is None or reads[block] != 1:
        return None
    if is_standard(product, "MatMul"):
        return product
    plain = all(attribute(product, flag, 0) == 0 for flag in ("transBatchA", "transBatchB"))
    fused = product.op_type == "FusedMatMul" and product.domain == ORT_DOMAIN
    return product if fused and plain else None


def _transposed(product: onnx.NodeProto) -> onnx.NodeProto:
    """A FusedMatMul computing `product`'s transpose: op(B)^T op(A)^T."""
    trans_a, trans_b = attribute(product, "transA", 0), attribute(product, "transB", 0)
    alpha = attribute(product, "alpha", 1.0)
    a, b = product.input
    return onnx.helper.make_node(
        "FusedMatMul", [b, a], list(product.output), name=product.name, domain=ORT_DOMAIN,
        transA=1 - trans_b, transB=1 - trans_a, alpha=alpha)

