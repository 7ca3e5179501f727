"""Stage 3c: a loss's ignored rows left out of its backward's products and its forward's
log-softmax (`rewrite_forward`, at the end).

Cross-entropy with an `ignore_index` (masked-language-model labels, -100 wherever a token is
not masked, 85% of a BERT batch; a causal LM's padding) gives the ignored rows of its logits'
gradient no weight. After `peephole.py` that gradient is `scatter_add(softmax(x) * -r, 1, i, r)`
(or `exp(l)` for the softmax, `l` the forward's log-softmax where the logits are not kept) with
`r = where(kept, w, 0)` (times a number), one weight per row, so a row not kept is
`softmax(x_row) * 0`: zeros where the row is finite. The head's backward then ran every row
through a softmax, two products as large as the forward's and a sum: on a vocabulary head the
largest part of the backward, and its peak (two logits-sized buffers).

Here the kept rows are picked (`nonzero`, their number each call's: a size the graph computes),
the gradient is computed for them alone, and each reader of the full gradient is given what it
computed from it, where the rows not kept add nothing:

- `mm(g, w)` (the logits' input's gradient): the picked rows' product, written into zeros at
  their rows (a zero row of `g` times `w` is zero);
- `mm(g.t(), y)` (the weight's gradient): the product of the picked rows of `g` and `y`, the
  same sum over rows without its zero terms;
- `sum(g, leading dims)` (the bias's gradient): the sum of the picked rows;
- `add(g, t)`, the gradient of another term of the loss that reads the logits (a distillation's
  divergence, an auxiliary score's mean; `t` as large as `g`): `t`, its picked rows plus theirs,
  a copy of `t` where the dense gradient took a softmax, a product and a sum over every row;

through views that keep the rows and casts (autocast's copy of the gradient into float16 for
the head's products, cast again from the picked rows).

A reader that is anything else leaves the graph as it is, and so does a head of few classes
(`CLASSES_AT_LEAST`) or a loss whose kept rows are not known to be few: the picking reads the
logits twice more (a copy of the kept rows, a sum for the check below), which pays where most
rows are ignored and costs a logits-sized copy at the backward's peak where few are (a causal
LM's shifted labels ignore one position a sequence). So the rewrite is made where the first
call's labels (an input of the call, or made from one in the forward, as a causal LM shifts
them) kept at most `KEPT_AT_MOST` of the rows: masked-LM labels, a fine-tuning's prompt masked
out; a later call keeping more is computed right, only slower.

The values are the same up to the order of the sums' roundings and the sign of a zero. Where
a row not kept is not finite (an overflow in float16), eager's gradient is NaN there and in
every product it reaches (0 * inf); so where `sum(x)` is not finite every row is picked, and
that call's gradient is the dense one (from `l`: where `sum(l) + exp(max(l))` is not, so an
`exp` that overflows counts too; a head's input or weight that is not finite makes its
logits so). Not a gradient formula: the derivatives are the partition's, this only skips
terms known zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lazygrad.capture import private
from lazygrad.capture.node_maker import Maker, value_of
from lazygrad.capture.partition import output_node, placeholders, rebuilt
from lazygrad.capture.peephole import known, same_shape
from lazygrad.capture.tidy import Feed, Tidy, unaliased

aten = torch.ops.aten
prims = torch.ops.prims

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.alias.default, aten.detach.default}
KEPT_AT_MOST = 0.5  # of the rows, in the first call, for the rewrite to be made
# Classes a row, at least: on a few (a sentence pair's two, a tagger's labels) the rows skipped
# save less than the picking's dozen ops cost.
CLASSES_AT_LEAST = 256


def rewrite(gm: fx.GraphModule, inputs: Callable[[fx.Node], torch.Tensor | None]) -> int:
    """Apply to every cross-entropy gradient of `gm` (a backward) whose readers allow it and
    whose first call kept few rows, in place; how many. `inputs`: the first call's value of one
    of the graph's inputs (`first_call_inputs`), or None where unknown."""
    return _each(gm, aten.scatter_add.default,
                 lambda node: _skip_ignored_rows(gm.graph, node, inputs))


def _each(gm: fx.GraphModule, target: Any, rewrite_one: Callable[[fx.Node], int]) -> int:
    """`rewrite_one` (1 if it rewrote, else 0) on each node of `target` still in the graph;
    how many it rewrote, the graph rebuilt if any."""
    fired = 0
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and node.target is target:
            fired += rewrite_one(node)
    if fired:
        rebuilt(gm)
    return fired


def _kept_rows(weight: Any) -> fx.Node | None:
    """`kept` where `weight` is `where(kept, w, 0)`, times a number or not: zero off `kept`."""
    if isinstance(weight, fx.Node) and weight.target is aten.mul.Tensor and not weight.kwargs:
        numbers = [a for a in weight.args if isinstance(a, (int, float))]
        nodes = [a for a in weight.args if isinstance(a, fx.Node)]
        if len(numbers) == 1 and len(nodes) == 1 and math.isfinite(numbers[0]):  # 0 * inf
            weight = nodes[0]
    if not isinstance(weight, fx.Node) or weight.target is not aten.where.self:
        return None
    kept, _, zero = weight.args
    is_zero = zero == 0 if isinstance(zero, (int, float)) else (
        isinstance(zero, fx.Node) and zero.target is aten.scalar_tensor.default
        and zero.args[0] == 0)
    kept_val, weight_val = value_of(kept), value_of(weight)
    if not is_zero or kept_val is None or kept_val.dtype != torch.bool \
            or not same_shape(kept_val, weight_val):
        return None
    return kept


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(probabilities, row weight, targets, kept) of `scatter_add(p * -r, 1, i, r)`, `p` the
    softmax of the logits by rows."""
    if node.kwargs or len(node.args) != 4:
        return None
    product, dim, index, weight = node.args
    out = value_of(node)
    if out is None or out.dim() != 2 or dim % 2 != 1 or not isinstance(product, fx.Node) \
            or product.target is not aten.mul.Tensor or product.kwargs \
            or not known(out.shape[1] >= CLASSES_AT_LEAST):
        return None
    for probabilities, negated in (product.args, reversed(product.args)):
        probabilities = unaliased(probabilities)
        if not (isinstance(probabilities, fx.Node) and isinstance(negated, fx.Node)
                and _row_wise(probabilities)
                and negated.target is aten.neg.default and negated.args[0] is weight):
            continue
        source = probabilities.args[0]
        kept = _kept_rows(weight)
        rows = value_of(weight)
        if kept is None or rows.dim() != 2 or not known(rows.shape[1] == 1) \
                or not same_shape(value_of(source), out):
            return None
        return probabilities, weight, index, kept
    return None


def _row_wise(probabilities: fx.Node) -> bool:
    """The probabilities, row by row: `_softmax(x, 1)` of the logits, or `exp(l)` of a saved
    log-softmax (where the logits are not kept, the backward reads the forward's)."""
    if probabilities.target is aten.exp.default:
        return len(probabilities.args) == 1 and not probabilities.kwargs
    return probabilities.target is aten._softmax.default and len(probabilities.args) == 3 \
        and probabilities.args[1] % 2 == 1 and not probabilities.args[2]


def value_in_first_call(node: fx.Node, inputs: Callable[[fx.Node], torch.Tensor | None]
                        ) -> Any:
    """`node`'s value in the first call, where it is made from one of its graph's inputs (whose
    value `inputs` gives, or None) by ops of one tensor each, and of sizes (a dynamic graph's
    `view(labels, [s0 * 12])`, its sizes read from that call's tensors); else None."""
    if node.op == "placeholder":
        return inputs(node)
    arguments = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                 if isinstance(a, fx.Node)]
    if node.op != "call_function" or sum(not _is_size(a) for a in arguments) > 1:
        return None
    values = {a: value_in_first_call(a, inputs) for a in arguments}
    if any(value is None for value in values.values()):
        return None
    args, kwargs = pytree.tree_map(lambda a: values[a] if isinstance(a, fx.Node) else a,
                                   (node.args, node.kwargs))
    return node.target(*args, **kwargs)


def _is_size(node: fx.Node) -> bool:
    return isinstance(value_of(node), (int, torch.SymInt))


def first_call_inputs(tidied: Tidy, primals: Sequence[torch.Tensor], graph: str = "backward"
                      ) -> Callable[[fx.Node], torch.Tensor | None]:
    """The first call's value of an input of `tidied`'s `graph` ("forward" or "backward"): an
    input of the call, or for the backward a forward result made from one (a causal LM's labels
    shifted in its forward: `F.pad(labels)[..., 1:]`)."""
    def primal(feed: Feed) -> torch.Tensor | None:
        value = primals[feed.index] if feed.kind == "primal" else None
        return None if isinstance(value, private.FakeTensor) else value

    forward_feeds = dict(zip(placeholders(tidied.forward), tidied.forward_feeds, strict=True))
    if graph == "forward":
        return lambda node: primal(forward_feeds[node])
    results = output_node(tidied.forward).args[0]
    backward_feeds = dict(zip(placeholders(tidied.backward), tidied.backward_feeds, strict=True))

    def of(node: fx.Node) -> torch.Tensor | None:
        feed = backward_feeds[node]
        if feed.kind == "saved" and isinstance(results[feed.index], fx.Node):
            return value_in_first_call(results[feed.index], lambda p: primal(forward_feeds[p]))
        return primal(feed)

    return of


def _kept_share(kept: fx.Node, inputs: Callable[[fx.Node], torch.Tensor | None]) -> float | None:
    """The share of rows `kept` kept in the first call (`labels.view(-1).unsqueeze(1) != -100`),
    or None where unknown."""
    try:
        value = value_in_first_call(kept, inputs)
    except Exception:  # an op on the labels this code did not expect: no rewrite, no harm
        return None
    return float(value.float().mean()) if value is not None and value.numel() else None


def _is_transpose(node: fx.Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:]) == [0, 1]
    return node.target is aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0]


def _is_cast(node: fx.Node, read: fx.Node) -> bool:
    """A copy into another floating dtype, on the same device, of the same shape: row by row."""
    value, source = value_of(node), value_of(read)
    if node.target is prims.convert_element_type.default:
        copy = len(node.args) == 2 and not node.kwargs
    else:
        copy = node.target is aten._to_copy.default and len(node.args) == 1 \
            and set(node.kwargs) <= {"dtype", "layout", "device", "memory_format"}
    return copy and value is not None and value.is_floating_point() \
        and value.device == source.device and value.layout == torch.strided \
        and same_shape(value, source)


# (kind, the reader, the casts before it, for an addend its other term, else None)
Reader = tuple[str, fx.Node, tuple[fx.Node, ...], fx.Node | None]


def _readers(gradient: fx.Node) -> list[Reader] | None:
    """(kind, reader, casts, other) for every reader of `gradient`, through views that keep its
    rows (the last dimension kept, the leading ones merged or split) and casts (autocast's), if
    each is a product, a sum over rows or a sum with a tensor of its shape and type; None if one
    is not."""
    rows, width = value_of(gradient).shape
    found: list[Reader] = []
    pending = [(gradient, ())]
    visited = set()
    while pending:
        read, casts = pending.pop()
        visited.add(read)
        shape = value_of(read).shape
        for user in read.users:
            value = value_of(user)
            if user.target in _VIEWS and value is not None and value.dim() >= 1 \
                    and known(value.shape[-1] == width) \
                    and known(value.numel() == rows * width):
                pending.append((user, casts))
            elif _is_cast(user, read):
                pending.append((user, (*casts, user)))
            elif user.target is aten.mm.default and user.args[0] is read and len(shape) == 2:
                found.append(("product", user, casts, None))
            elif len(shape) == 2 and _is_transpose(user) and user.users and all(
                    u.target is aten.mm.default and u.args[0] is user
                    and known(value_of(u.args[1]).shape[0] == rows) for u in user.users):
                found.extend(("weight", u, casts, None) for u in user.users)
            elif user.target is aten.sum.dim_IntList and not user.kwargs and \
                    sorted(d % len(shape) for d in user.args[1]) == list(range(len(shape) - 1)):
                found.append(("sum", user, casts, None))
            elif (other := _addend(user, read)) is not None:
                found.append(("addend", user, casts, other))
            else:
                return None
    # A sum of two views of the gradient itself is every row of it.
    if any(other in visited for *_, other in found):
        return None
    return found


def _addend(user: fx.Node, read: fx.Node) -> fx.Node | None:
    """The other term of `user` where it is `read + t` (or `t + read`), `t` a tensor of the
    same shape and type, so that the sum is `t` with `read` added row by row."""
    if user.target is not aten.add.Tensor or user.kwargs or len(user.args) != 2:
        return None
    others = [a for a in user.args if a is not read]
    if len(others) != 1 or not isinstance(others[0], fx.Node):
        return None
    values = [value_of(n) for n in (user, read, others[0])]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return None
    return others[0] if all(same_shape(v, values[0]) and v.dtype == values[0].dtype
                            for v in values[1:]) else None


def _skip_ignored_rows(graph: fx.Graph, gradient: fx.Node,
                       inputs: Callable[[fx.Node], torch.Tensor | None]) -> int:
    """1 if the rewrite was made, else 0 and the graph as it was: an op this code did not
    expect among the new ones (their metadata failing on fake tensors) leaves the graph dense,
    never the model in parts."""
    matched = _match(gradient)
    readers = _readers(gradient) if matched is not None else None
    if not readers:
        return 0
    probabilities, weight, index, kept = matched
    share = _kept_share(kept, inputs)
    if share is None or share > KEPT_AT_MOST:
        return 0
    make = Maker(graph, probabilities)
    if not make.counts_sizes:
        return 0  # no symbols here to count the picked rows with
    try:
        replacements = _picked(make, gradient, matched, readers)
    except Exception:
        make.undo()
        return 0
    for reader, made in replacements:
        reader.replace_all_uses_with(made)
        graph.erase_node(reader)
    return 1


def _picked(make: Maker, gradient: fx.Node, matched: tuple[fx.Node, ...],
            readers: list[Reader]) -> list[tuple[fx.Node, fx.Node]]:
    """The kept rows' gradient, and for each reader what replaces it."""
    probabilities, weight, index, kept = matched
    logits = probabilities.args[0]  # or the log-softmax
    flat = make(gradient, aten.view.default, kept, [-1])
    total = make(gradient, aten.sum.default, logits)  # not finite where one of them is not
    if probabilities.target is aten.exp.default:  # nor where the largest's exponent overflows
        total = make(gradient, aten.add.Tensor, total, make(
            gradient, aten.exp.default, make(gradient, aten.amax.default, logits, [0, 1])))
    overflow = make(gradient, aten.logical_not.default,
                    make(gradient, aten.isfinite.default, total))
    rows = make.nonzero(gradient, make(gradient, aten.logical_or.default, flat, overflow))

    def pick(before: fx.Node, node: fx.Node) -> fx.Node:
        return make(before, aten.index_select.default, node, 0, rows)

    row_weight = pick(gradient, weight)
    picked_probabilities = make(gradient, probabilities.target, pick(gradient, logits),
                                *probabilities.args[1:])
    scaled = make(gradient, aten.mul.Tensor, picked_probabilities,
                  make(gradient, aten.neg.default, row_weight))
    picked_gradient = make(gradient, aten.scatter_add.default, scaled, 1, pick(gradient, index),
                           row_weight)
    replacements = []
    for kind, reader, casts, other in readers:
        read = picked_gradient
        for cast in casts:
            read = make(reader, cast.target, read, *cast.args[1:], **cast.kwargs)
        if kind == "product":
            product = make(reader, aten.mm.default, read, reader.args[1])
            zeros = make(reader, aten.new_zeros.default, product,
                         [make.size(reader, logits, 0), make.size(reader, reader.args[1], 1)])
            made = make(reader, aten.index_put.default, zeros, [rows], product)
        elif kind == "weight":
            made = make(reader, aten.mm.default,
                        make(reader, aten.t.default, read), pick(reader, reader.args[1]))
        elif kind == "addend":
            rows_of_other = make(reader, aten.view.default, other, [
                make.size(reader, logits, 0), make.size(reader, logits, 1)])
            summed = make(reader, aten.index_put.default, rows_of_other, [rows], make(
                reader, aten.add.Tensor, pick(reader, rows_of_other), read))
            made = make(reader, aten.view.default, summed, [
                make.size(reader, other, d) for d in range(value_of(other).dim())])
        else:
            total = make(reader, aten.sum.dim_IntList, read, [0])
            ones = [1] * (value_of(reader).dim() - 1)  # the rows' dimensions, kept or not
            made = make(reader, aten.view.default, total, [*ones, make.size(reader, logits, 1)])
        replacements.append((reader, made))
    return replacements


# The ops between a forward's pick of the label's log-probability and the `where` that zeroes
# it on the ignored rows, as cross-entropy decomposes (`nll_loss`: squeeze, negate, where).
_ROW_WISE_BETWEEN = {aten.squeeze.dim, aten.neg.default}


def rewrite_forward(gm: fx.GraphModule, inputs: Callable[[fx.Node], torch.Tensor | None]
                    ) -> int:
    """The forward's side, in place: the label's log-probability computed for the kept rows
    alone, where only they are read (`gather(_log_softmax(x, 1), 1, i)` zeroed off the kept rows
    by a `where`) and the first call kept few; how many. The log-softmax over every row was a
    transient as large as the logits at the forward's peak (62 MiB on workload B of
    `benchmarks/memory.py`, whose loss ignores 85% of the rows); the kept rows' is that share of
    it. A row's log-softmax is computed from that row alone, so a kept row's value is the one
    the full op gives; an ignored row's, which the `where` drops, is zero instead (eager's
    `where` drops it whatever it is, a NaN of an overflowed row included)."""
    return _each(gm, aten.gather.default,
                 lambda node: _pick_kept_rows_forward(gm.graph, node, inputs))


def _same_op(a: Any, b: Any) -> bool:
    """The same node, or one computing the same op of the same arguments (`ne(t, -100)` made
    once for the pick's index and again for the `where`)."""
    return a is b or (isinstance(a, fx.Node) and isinstance(b, fx.Node)
                      and a.op == b.op == "call_function" and a.target == b.target
                      and a.args == b.args and a.kwargs == b.kwargs)


def _forward_match(gather: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(logits, index, kept) of `gather(_log_softmax(x, 1), 1, unsqueeze(where(kept, t, 0),
    1))` whose only reader leads, through row-wise ops, to `where(kept, ., 0)`."""
    if gather.kwargs or len(gather.args) != 3:
        return None
    log_softmax, dim, index = gather.args
    if not (isinstance(log_softmax, fx.Node) and log_softmax.target is aten._log_softmax.default
            and len(log_softmax.users) == 1 and log_softmax.args[1:] in ((1, False), (-1, False))
            and dim in (1, -1) and isinstance(index, fx.Node)):
        return None
    logits = log_softmax.args[0]
    logits_val, index_val = value_of(logits), value_of(index)
    if logits_val is None or index_val is None or logits_val.dim() != 2 \
            or index_val.dim() != 2 or not known(index_val.shape[1] == 1) \
            or not known(index_val.shape[0] == logits_val.shape[0]) \
            or not known(logits_val.shape[1] >= CLASSES_AT_LEAST):
        return None
    labels = index.args[0] if index.target is aten.unsqueeze.default else None
    kept = _kept_rows(labels) if isinstance(labels, fx.Node) else None
    if kept is None or value_of(kept).dim() != 1:
        return None
    read = gather
    while len(read.users) == 1:
        (reader,) = read.users
        if reader.target is aten.where.self:
            return (logits, index, kept) if reader.args[1] is read \
                and _same_op(_kept_rows(reader), kept) else None
        if reader.target not in _ROW_WISE_BETWEEN or reader.args[0] is not read:
            return None
        read = reader
    return None


def _pick_kept_rows_forward(graph: fx.Graph, gather: fx.Node,
                            inputs: Callable[[fx.Node], torch.Tensor | None]) -> int:
    """1 if the forward rewrite was made, else 0 and the graph as it was."""
    matched = _forward_match(gather)
    if matched is None:
        return 0
    logits, index, kept = matched
    share = _kept_share(kept, inputs)
    if share is None or share > KEPT_AT_MOST:
        return 0
    make = Maker(graph, gather)
    if not make.counts_sizes:
        return 0
    log_softmax = gather.args[0]
    try:
        rows = make.nonzero(gather, kept)
        picked_log_softmax = make(gather, aten._log_softmax.default,
                                  make(gather, aten.index_select.default, logits, 0, rows),
                                  *log_softmax.args[1:])
        picked = make(gather, aten.gather.default, picked_log_softmax, 1,
                      make(gather, aten.index_select.default, index, 0, rows))
        zeros = make(gather, aten.new_zeros.default, picked,
                     [make.size(gather, logits, 0), 1])
        made = make(gather, aten.index_put.default, zeros, [rows], picked)
    except Exception:
        make.undo()
        return 0
    gather.replace_all_uses_with(made)
    graph.erase_node(gather)
    graph.erase_node(log_softmax)
    return 1
