"""Stage 3, tidy: make the forward/backward pair cheap and exportable, and say how to feed it.

- A saved tensor that is a view (view, transpose, permute, select, detach ...) of another forward
  tensor is not returned by the forward: its base is, and the backward redoes the view. In eager
  a view shares its base's storage; as two ONNX graph outputs they would be two copies.
- The autograd node returns the roots of the module's outputs (`aliases.py`); each output is
  made from its root (or from a primal) by views applied in torch (`OutputView`), free and
  changeable in place as in eager; the backward takes one cotangent per root that gets one.
- Saved primals (parameters, inputs) and draws are fed to the backward directly, not returned.
- Saved sizes (SymInts) are recomputed in the backward from its tensor inputs' shapes.
- Gradients that are None are dropped; `grads_for` says which primals the others belong to.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lazygrad.capture import symbols
from lazygrad.capture.aliases import Aliasing
from lazygrad.capture.errors import CaptureError
from lazygrad.capture.partition import Partitioned, output_node, placeholders, rebuilt
from lazygrad.capture.views import VIEW_OPS

aten = torch.ops.aten

@dataclasses.dataclass(frozen=True)
class Feed:
    """Where one graph input comes from at run time."""

    kind: str  # "primal", "random", "saved" (a forward result) or "cotangent" (of an output)
    index: int


@dataclasses.dataclass
class OutputSlot:
    """A root (`aliases.py`), what the autograd node returns: forward result `index`, then
    `views` applied in torch (reshapes of a result that is not a view in eager)."""

    index: int
    views: list[tuple[str, list[Any]]]  # (aten overload name, args after the base; sizes as code)


@dataclasses.dataclass
class OutputView:
    """A module output, made in torch outside the autograd node: `views` applied to root
    `index` (`source` "root") or to primal `index` (`source` "primal"); no views: it is that
    tensor itself."""

    source: str
    index: int
    views: list[tuple[str, list[Any]]]


@dataclasses.dataclass
class Tidy:
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    forward_feeds: list[Feed]  # per forward placeholder
    backward_feeds: list[Feed]  # per backward placeholder
    mutations: list[tuple[int, int]]  # (forward result index, primal index) to write back
    roots: list[OutputSlot]
    outputs: list[OutputView]  # per module output
    grads_for: list[int]  # primal index of each backward output
    grad_reach: list[list[int]]  # per backward output: the roots whose cotangents reach it
    check: int | None = None  # the forward result saying whether its argument checks held


def tidy(parts: Partitioned, num_primals: int, mutated: list[int], num_outputs: int,
         aliasing: Aliasing, masked: list[int], checked: bool = False,
         leaf_updates: int = 0) -> Tidy:
    """`num_outputs`: how many tensors the traced function returned (its roots, then its other
    outputs, then whether its checks held if `checked`: `trace.Functional`); `masked`: the roots
    that have a cotangent, in order; `leaf_updates`: how many of the `mutated` primals that
    require grad are leaves (parameters), when all of them are
    (`_without_leaf_update_cotangents`)."""
    fw, bw = parts.forward, parts.backward
    for gm in (fw, bw):
        if gm is not None:
            _expand_numel(gm)
    fw_inputs = placeholders(fw)
    feed_of_fw_input = {
        node.name: Feed("primal", i) if i < num_primals else Feed("random", i - num_primals)
        for i, node in enumerate(fw_inputs)
    }
    results = list(output_node(fw).args[0])
    n_mut = len(mutated)
    mutation_results = results[:n_mut]
    user = results[n_mut : n_mut + num_outputs]
    saved = results[n_mut + num_outputs :]
    held = user.pop() if checked else None

    sources: dict[str, fx.Node] = {}  # backward placeholder name -> the forward node it reads
    backward_feeds: list[Feed] = []
    grads_for: list[int] = []
    grad_reach: list[list[int]] = []
    if bw is not None:
        sources = _tidy_backward(fw, bw, saved)
    forward_results: list[fx.Node] = []

    def slot(node: fx.Node) -> int:
        if node not in forward_results:
            forward_results.append(node)
        return forward_results.index(node)

    mutations = [(slot(node), primal) for node, primal in zip(mutation_results, mutated)]
    root_nodes = user[: aliasing.root_count]
    roots = []
    for node in root_nodes:
        base, chain = strip_views(node)
        roots.append(OutputSlot(slot(base), [_view_step(view) for view in reversed(chain)]))
    outputs = _output_views(aliasing, root_nodes, iter(user[aliasing.root_count :]), fw_inputs)
    check = None if held is None else slot(held)
    for node in sources.values():
        if node.op != "placeholder":
            slot(node)  # a forward intermediate the backward reads (a base, never a view)
    output_node(fw).args = (tuple(forward_results),)
    rebuilt(fw)

    if bw is not None:
        tangents = [p for p in placeholders(bw) if p.name.startswith("tangents")]
        if leaf_updates and len(tangents) == len(masked) + leaf_updates:
            tangents = _without_leaf_update_cotangents(bw, tangents, leaf_updates)
        if len(tangents) != len(masked):
            raise CaptureError(
                f"the backward takes {len(tangents)} cotangents where {len(masked)} outputs "
                "get one (an input that requires grad changed in place, or outputs that share "
                "memory in a way lazygrad cannot map)"
            )
        cotangent_of = {p.name: masked[i] for i, p in enumerate(tangents)}
        for node in placeholders(bw):
            if node.name in cotangent_of:
                backward_feeds.append(Feed("cotangent", cotangent_of[node.name]))
            elif sources[node.name].op == "placeholder":
                backward_feeds.append(feed_of_fw_input[sources[node.name].name])
            else:
                backward_feeds.append(Feed("saved", forward_results.index(sources[node.name])))
        grads = list(output_node(bw).args[0])
        grads_for = [i for i, g in enumerate(grads[:num_primals]) if g is not None]
        output_node(bw).args = (tuple(grads[i] for i in grads_for),)
        rebuilt(bw)
        reach = _reached_by(bw, {p.name: cotangent_of[p.name] for p in tangents})
        grad_reach = [sorted(reach.get(node, ())) for node in output_node(bw).args[0]]
    return Tidy(
        forward=fw,
        backward=bw,
        forward_feeds=[feed_of_fw_input[p.name] for p in placeholders(fw)],
        backward_feeds=backward_feeds,
        mutations=mutations,
        roots=roots,
        outputs=outputs,
        grads_for=grads_for,
        grad_reach=grad_reach,
        check=check,
    )


def _tidy_backward(
    fw: fx.GraphModule, bw: fx.GraphModule, saved: list[Any]
) -> dict[str, fx.Node]:
    """Rewrite `bw` to read bases instead of views and sizes from shapes; return, for each of
    its placeholders but the tangents, the forward node (input or intermediate) it reads."""
    saved_by_name = {node.name: node for node in saved if isinstance(node, fx.Node)}
    bw_inputs = placeholders(bw)
    first = next(n for n in bw.graph.nodes if n.op != "placeholder")
    fw_nodes = {node.name: node for node in fw.graph.nodes}
    # AOTAutograd names each backward input after the forward node it is: the map starts so,
    # and placeholders added below (whose names may be changed to stay unique) join it.
    # A saved size may be named after a joint node the forward computes under another name
    # (the partitioner remakes sizes from its inputs' shapes): sizes are recomputed below.
    sources = {p.name: fw_nodes[p.name] for p in bw_inputs if not p.name.startswith("tangents")
               and not (p.name not in fw_nodes and symbols.is_symbolic(p.meta.get("val")))}
    by_name = {p.name: p for p in bw_inputs}  # forward node name -> backward placeholder

    def placeholder_for(base: fx.Node) -> fx.Node:
        found = by_name.get(base.name)
        if found is None:
            with bw.graph.inserting_before(first):
                found = bw.graph.placeholder(base.name)
            found.target = found.name  # FX made the name unique: the argument must follow
            found.meta.update(base.meta)
            by_name[base.name] = found
            sources[found.name] = base
        return found

    rewrites = []
    for node in bw_inputs:
        source = saved_by_name.get(node.name)
        if source is None or symbols.is_symbolic(source.meta.get("val")):
            continue
        base, chain = strip_views(source)
        if chain:
            rewrites.append((node, base, chain))
            placeholder_for(base)

    # Sizes are read from inputs that stay: not from a view input replaced below.
    where = _size_sources(bw, fw, placeholder_for, {node for node, _, _ in rewrites})
    for node, base, chain in rewrites:
        current = by_name[base.name]
        with bw.graph.inserting_before(first):
            for view in reversed(chain):
                rest = pytree.tree_map(lambda a: symbols.emit(bw.graph, a.meta["val"], where)
                                       if isinstance(a, fx.Node) else a,
                                       (view.args[1:], view.kwargs))
                made = bw.graph.call_function(view.target, (current, *rest[0]), rest[1])
                made.meta.update(view.meta)
                current = made
        node.replace_all_uses_with(current)
        if by_name.get(node.name) is node and not node.users:
            bw.graph.erase_node(node)
            del by_name[node.name]

    for node in [p for p in placeholders(bw) if symbols.is_symbolic(p.meta.get("val"))]:
        with bw.graph.inserting_before(first):
            value = symbols.emit(bw.graph, node.meta["val"], where)
        node.replace_all_uses_with(value)
        bw.graph.erase_node(node)
    for node in placeholders(bw):
        if not node.users and not node.name.startswith("tangents"):
            bw.graph.erase_node(node)
    return {p.name: sources[p.name] for p in placeholders(bw) if p.name in sources}


def _size_sources(
    bw: fx.GraphModule, fw: fx.GraphModule, placeholder_for, replaced: set[fx.Node]
) -> dict:
    """symbol name -> (backward tensor input, dim); a forward input is added where needed."""
    kept = [p for p in placeholders(bw) if p not in replaced]
    where = {
        name: (kept[index], dim)
        for name, (index, dim) in symbols.locations([p.meta.get("val") for p in kept]).items()
    }
    fw_inputs = placeholders(fw)
    for name, (index, dim) in symbols.locations([p.meta.get("val") for p in fw_inputs]).items():
        if name not in where:
            where[name] = _LazySource(fw_inputs[index], dim, placeholder_for)
    return _Where(where)


class _LazySource:
    """A forward input that carries a size symbol, added to the backward only if used."""

    def __init__(self, node: fx.Node, dim: int, placeholder_for) -> None:
        self.node, self.dim, self.placeholder_for = node, dim, placeholder_for

    def resolve(self) -> tuple[fx.Node, int]:
        return self.placeholder_for(self.node), self.dim


class _Where(dict):
    def __getitem__(self, key: str) -> tuple[fx.Node, int]:
        value = super().__getitem__(key)
        if isinstance(value, _LazySource):
            value = value.resolve()
            self[key] = value
        return value


def _without_leaf_update_cotangents(bw: fx.GraphModule, tangents: list[fx.Node],
                                    leaf_updates: int) -> list[fx.Node]:
    """The backward's cotangents without the first `leaf_updates` (AOTAutograd puts those of
    changed inputs first), those of leaves that require grad and the forward changed in place
    (so under no_grad: `Embedding(max_norm=...)` renormalising its rows).

    AOTAutograd gives such an input's new value a cotangent, which it adds to the input's
    gradient: the gradient that later uses of the new value send back through it. lazygrad
    writes the new value back into the leaf, which stays a leaf as in eager, so later uses
    accumulate into its `.grad` themselves and this cotangent is zero: each sum it enters is its
    other term. Used any other way (the change was seen by autograd), the capture is refused."""
    extra = tangents[:leaf_updates]
    if not all(_only_added(node) for node in extra):
        return tangents
    for node in extra:
        for user in list(node.users):
            if user.op == "output":
                user.args = (pytree.tree_map(
                    lambda arg, cotangent=node: None if arg is cotangent else arg, user.args[0]),)
            else:
                other = user.args[1] if user.args[0] is node else user.args[0]
                user.replace_all_uses_with(other)
                bw.graph.erase_node(user)
        bw.graph.erase_node(node)
    bw.recompile()
    return tangents[leaf_updates:]


def _only_added(tangent: fx.Node) -> bool:
    """Whether `tangent` is only returned or added to a tensor of its own size and dtype."""
    value = tangent.meta.get("val")
    for user in tangent.users:
        if user.op == "output":
            continue
        if user.target != aten.add.Tensor or len(user.args) != 2 or user.kwargs:
            return False
        other = user.args[1] if user.args[0] is tangent else user.args[0]
        seen = getattr(other, "meta", {}).get("val")
        if other is tangent or value is None or seen is None or seen.shape != value.shape \
                or seen.dtype != value.dtype:
            return False
    return True


def _expand_numel(gm: fx.GraphModule) -> None:
    """`sym_numel(t)` (no ONNX translation) -> the product of `sym_size(t, d)`."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.sym_numel.default:
            continue
        tensor = node.args[0]
        with gm.graph.inserting_before(node):
            product: Any = 1
            for dim, size in enumerate(tensor.meta["val"].shape):
                factor: Any = size
                if symbols.is_symbolic(size):
                    factor = gm.graph.call_function(aten.sym_size.int, (tensor, dim))
                    factor.meta["val"] = size
                if isinstance(product, int) and isinstance(factor, int):
                    product *= factor
                else:
                    value = _value(product) * _value(factor)
                    product = gm.graph.call_function(operator.mul, (product, factor))
                    product.meta["val"] = value
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    gm.recompile()


def _value(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def strip_views(node: Any) -> tuple[Any, list[fx.Node]]:
    """A node's base and the view ops between (outermost first), where the views' sizes are
    symbolic or constant."""
    chain = []
    while (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in VIEW_OPS
        and all(
            symbols.is_symbolic(a.meta.get("val"))
            for a in pytree.tree_leaves((node.args[1:], node.kwargs))
            if isinstance(a, fx.Node)
        )
    ):
        chain.append(node)
        node = node.args[0]
    return node, chain


_IDENTITY = {aten.detach.default, aten.alias.default}


def unaliased(node: Any) -> Any:
    """The value behind the `detach`es and `alias`es AOTAutograd puts between a value and the
    backward's read of it."""
    while isinstance(node, fx.Node) and node.target in _IDENTITY:
        node = node.args[0]
    return node


def _output_views(aliasing: Aliasing, root_nodes: list[fx.Node], others: Iterator[fx.Node],
                  fw_inputs: list[fx.Node]) -> list[OutputView]:
    """How to make each module output from its root (or primal): the traced views between."""
    outputs = []
    for (source, index), view in zip(aliasing.sources, aliasing.views):
        if source == "root" and not view:
            outputs.append(OutputView(source, index, []))
            continue
        node = next(others)
        start = root_nodes[index] if source == "root" else fw_inputs[index]
        outputs.append(OutputView(source, index, _views_from(start, node)))
    return outputs


def _views_from(start: fx.Node, node: fx.Node) -> list[tuple[str, list[Any]]]:
    """The view steps that make `node` from `start`'s value. `start` may itself be made by
    reshapes or aliases of the node the views were traced from (a root detached, or
    `_unsafe_view` after a matmul): that value is reached from `start` by a reshape first."""
    reached = {start: []}
    current, steps = start, []
    while isinstance(current, fx.Node) and current.op == "call_function" and (
            current.target in _IDENTITY or current.target in _RESHAPES):
        if current.target in _RESHAPES:
            steps = [*steps, _reshape_to(current.args[0])]
        current = current.args[0]
        reached[current] = steps
    chain = []
    while node not in reached:
        if isinstance(node, fx.Node) and node.target in _IDENTITY:
            node = node.args[0]
            continue
        found = _as_view_step(node)
        if found is None:
            raise CaptureError(
                f"a module output is made by {getattr(node, 'target', node)} from what the "
                "forward computes, which lazygrad cannot apply as a view in torch"
            )
        step, node = found
        chain.append(step)
    return [*reached[node], *reversed(chain)]


_RESHAPES = {aten._unsafe_view.default, aten.view.default, aten.reshape.default}


def _reshape_to(node: fx.Node) -> tuple[str, list[Any]]:
    size = [d if isinstance(d, int) else {"size": symbols.to_code(d)}
            for d in node.meta["val"].shape]
    return aten.reshape.default.name(), [size]


def _as_view_step(node: Any) -> tuple[tuple[str, list[Any]], Any] | None:
    """`node` as one view step and the node it views; None where it is not a view."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return _piece_of(node)
    # Applied in torch, not in ONNX: any ATen view op of one tensor whose other arguments are
    # plain values or sizes. A prims view (`prims.squeeze`, from vmap's rules) has no
    # autograd formula: replayed in torch, the output's backward failed ("backwards not
    # supported on prim"); its ATen twin is applied instead.
    target = _ATEN_TWINS.get(node.target, node.target)
    if not getattr(target, "is_view", False) or target.namespace != "aten":
        return None
    sizes = [a for a in pytree.tree_leaves((node.args[1:], node.kwargs)) if isinstance(a, fx.Node)]
    if node.kwargs or not all(symbols.is_symbolic(a.meta.get("val")) for a in sizes):
        return None
    _, args = _view_step(node)
    return (target.name(), args), node.args[0]


# prims view ops and the ATen view that takes the same arguments
_ATEN_TWINS = {
    torch.ops.prims.squeeze.default: aten.squeeze.dims,
    torch.ops.prims.transpose.default: aten.permute.default,
    torch.ops.prims.view_of.default: aten.alias.default,
}


def _piece_of(node: fx.Node) -> tuple[tuple[str, list[Any]], Any] | None:
    """`split(x, ...)[i]` or `unbind(x, dim)[i]` as a slice or a select of x."""
    parent, index = node.args
    if not isinstance(parent, fx.Node) or not isinstance(index, int):
        return None
    if parent.target is aten.unbind.int:
        dim = parent.args[1] if len(parent.args) > 1 else 0
        return (aten.select.int.name(), [dim, index]), parent.args[0]
    if parent.target in (aten.split.Tensor, aten.split_with_sizes.default):
        sizes, dim = parent.args[1], parent.args[2] if len(parent.args) > 2 else 0
        if not all(isinstance(s, int) for s in pytree.tree_leaves(sizes)):
            return None
        start = index * sizes if isinstance(sizes, int) else sum(sizes[:index])
        end = start + (sizes if isinstance(sizes, int) else sizes[index])
        return (aten.slice.Tensor.name(), [dim, start, end]), parent.args[0]
    return None


def _view_step(node: fx.Node) -> tuple[str, list[Any]]:
    args = pytree.tree_map(
        lambda a: {"size": symbols.to_code(a.meta["val"])} if isinstance(a, fx.Node) else a,
        list(node.args[1:]),
    )
    return node.target.name(), args


def apply_views(steps: list[tuple[str, list[Any]]], base: torch.Tensor,
                env: dict[str, int]) -> torch.Tensor:
    """Apply an output's view chain in torch (sizes evaluated on this call's `env`)."""
    current = base
    for name, args in steps:
        namespace, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        concrete = pytree.tree_map(
            lambda a: int(symbols.evaluate(a["size"], env)) if isinstance(a, dict) else a,
            args, is_leaf=lambda a: isinstance(a, dict),
        )
        current = op(current, *concrete)
    return current


def _reached_by(bw: fx.GraphModule, tangent_index: dict[str, int]) -> dict[fx.Node, set[int]]:
    """Which outputs' cotangents each backward node depends on."""
    reach: dict[fx.Node, set[int]] = {}
    for node in bw.graph.nodes:
        if node.op == "placeholder":
            if node.name in tangent_index:
                reach[node] = {tangent_index[node.name]}
            continue
        found: set[int] = set()
        for arg in node.all_input_nodes:
            found |= reach.get(arg, set())
        if found:
            reach[node] = found
    return reach

