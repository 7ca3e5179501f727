"""Fewer logits-sized buffers in a vocabulary head: two rewrites of the partitioned graphs.

A language-model head computes `h @ W.t() + bias` and, for its loss, `log_softmax` of that,
from which `nll_loss` picks the label's entry. Traced as it is, ORT holds the matrix product
and the biased logits at once, then the full log-softmax beside the logits: three buffers of
batch x sequence x vocabulary (234 MiB each on workload A of `benchmarks/memory.py`) where the
result needs one. So, in each graph after the partition (where it is known what the backward
reads):

- `add(mm(a, b) [viewed], bias)`, a bias over the last dimension: `addmm(bias, a, b)` [viewed],
  one ONNX Gemm that writes the biased result in place;
- `gather(_log_softmax(x, d), d, i)` whose log-softmax nothing else reads (the backward does not
  save it, it is no output): `gather(x, d, i) - logsumexp(x, d)` (gathered), the same value
  (log_softmax(x) = x - logsumexp(x)), without the vocabulary-sized result.

A third rewrite spans the pair (`recompute_log_softmax`, before the two above): where the
backward reads `_log_softmax(x)` (cross-entropy's gradient is `exp(log_softmax(x))` less the
targets) and `x` is kept anyway (a module output, the logits a user gets, or saved already), the
backward computes `_log_softmax(x)` again from `x` instead of reading a saved one: one
logits-sized buffer less from the forward to the backward's head (62 MiB on workload B). The
backward runs the same op on the same values (`x - logsumexp(x)` from a saved row total came
out a few ulps apart, which 50 training steps grew past the exactness tests' 1e-4), and the
forward keeps its own log-softmax for the pick, freed once picked (`RECOMPUTED`). The backward
reads it as its exponent, which `peephole.softmax_for_exp` then computes in one pass.

All compute the same values as the ops they replace (not a gradient: derivatives come from
the partition before), and the check (`verify.py`) runs the rewritten FX graph against ORT.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from lazygrad.capture import symbols
from lazygrad.capture.partition import (
    Partitioned,
    output_node,
    placeholders,
    rebuilt,
    replace_node,
)
from lazygrad.capture.tidy import strip_views, unaliased

aten = torch.ops.aten
# On a forward log-softmax whose backward computes it again: the forward's stays (a transient
# the backward's head holds as well), not a `logsumexp`, which ORT's CPU provider runs at half
# the speed of its LogSoftmax (27 against 12 ms over 1024 x 8000, `benchmarks.profile`).
RECOMPUTED = "lazygrad_log_softmax_recomputed"


def recompute_log_softmax(parts: Partitioned, num_kept: int) -> None:
    """The pair rewrite, in place, for every saved log-softmax whose input is kept anyway.
    `num_kept`: the forward's leading results that outlive it regardless (mutated state and the
    module's outputs); the saved tensors follow them."""
    forward, backward = parts.forward, parts.backward
    if backward is None:
        return
    results = list(output_node(forward).args[0])
    kept, saved = results[:num_kept], results[num_kept:]
    alive = {strip_views(node)[0] for node in kept + saved if isinstance(node, fx.Node)}
    readers = {p.name: p for p in placeholders(backward)}
    changed = False
    for node in list(forward.graph.nodes):
        if not (node.target is aten._log_softmax.default and len(node.args) == 3
                and not node.args[2]):
            continue
        # AOTAutograd saves the result, and `detach`es of it, under their own names.
        copies = [n for n in saved if isinstance(n, fx.Node) and unaliased(n) is node]
        logits, dim = node.args[:2]
        if (not copies or any(n.name not in readers for n in copies)
                or strip_views(logits)[0] not in alive or _value(logits) is None):
            continue
        # Saved as an alias named as no node of either graph is: tidy (which reads a saved
        # view's base instead) finds it by the backward placeholder of the same name.
        read = _alias(forward, backward, logits)
        saved = [n for n in saved if n not in copies] + [read]
        _recompute(backward, [readers[n.name] for n in copies], read, node)
        node.meta[RECOMPUTED] = True
        changed = True
    if changed:
        output_node(forward).args = (tuple(kept + saved),)
        for gm in (forward, backward):
            rebuilt(gm)


def _alias(forward: fx.GraphModule, backward: fx.GraphModule, value: fx.Node) -> fx.Node:
    """`alias(value)` in the forward, right after it, named as no node of either graph is."""
    taken = {n.name for n in forward.graph.nodes} | {n.name for n in backward.graph.nodes}
    name = next(f"{value.name}_saved{i or ''}" for i in range(len(taken) + 1)
                if f"{value.name}_saved{i or ''}" not in taken)
    with forward.graph.inserting_after(value):
        alias = forward.graph.create_node("call_function", aten.alias.default, (value,), name=name)
    alias.meta.update(value.meta)
    return alias


def _recompute(backward: fx.GraphModule, readers: list[fx.Node], read: fx.Node,
               log_softmax: fx.Node) -> None:
    """The backward reads the forward's `read` (the logits), through a placeholder of its name
    as AOTAutograd names them, and computes from it the log-softmax the `readers` held: the same
    op on the same values, so the gradients are those of the graphs without this rewrite."""
    graph = backward.graph
    with graph.inserting_before(readers[0]):
        loaded = graph.placeholder(read.name)
    loaded.meta.update(read.meta)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        again = graph.call_function(log_softmax.target, (loaded, *log_softmax.args[1:]))
    again.meta.update(readers[0].meta)
    for reader in readers:
        reader.replace_all_uses_with(again)
        graph.erase_node(reader)


def rewrite(gm: fx.GraphModule) -> None:
    """Both rewrites, in place, wherever their pattern holds."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.add.Tensor:
            changed |= _bias_into_matmul(gm.graph, node)
        elif node.op == "call_function" and node.target is aten.gather.default:
            changed |= _pick_without_log_softmax(gm.graph, node)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _bias_into_matmul(graph: fx.Graph, add: fx.Node) -> bool:
    if add.kwargs or len(add.args) != 2:  # alpha= scales the bias
        return False
    for product, bias in (add.args, add.args[::-1]):
        if not isinstance(product, fx.Node) or not isinstance(bias, fx.Node):
            continue
        view = None
        if product.target in (aten.view.default, aten._unsafe_view.default):
            view, product = product, product.args[0]
        if not (isinstance(product, fx.Node) and product.target is aten.mm.default):
            continue
        if len(product.users) != 1 or (view is not None and len(view.users) != 1):
            continue  # the unbiased product is read elsewhere
        result, product_value, bias_value = (
            _value(add), _value(product), _value(bias)
        )
        if result is None or product_value is None or bias_value is None:
            continue
        shaped = product_value if view is None else _value(view)
        if (shaped is None or bias_value.dim() != 1 or bias_value.dtype != product_value.dtype
                or result.dtype != product_value.dtype
                or not symbols.same_sizes(result.shape, shaped.shape)
                or not symbols.same_sizes(bias_value.shape, product_value.shape[-1:])
                or not symbols.same_sizes(shaped.shape[-1:], product_value.shape[-1:])):
            continue
        with graph.inserting_before(add):
            fused = graph.call_function(aten.addmm.default, (bias, *product.args))
            fused.meta.update(product.meta)
            if view is not None:
                fused = graph.call_function(view.target, (fused, *view.args[1:]))
                fused.meta.update(view.meta)
        fused.meta["val"] = result
        replace_node(add, fused)
        return True
    return False


def _pick_without_log_softmax(graph: fx.Graph, gather: fx.Node) -> bool:
    source, dim, index = gather.args[:3]
    if gather.kwargs.get("sparse_grad") or len(gather.args) > 3:
        return False
    if not (isinstance(source, fx.Node) and source.target is aten._log_softmax.default):
        return False
    if len(source.users) != 1:  # saved for the backward, or an output
        return False
    if source.meta.get(RECOMPUTED):  # the backward makes one anyway: ORT's is the faster op
        return False
    logits, softmax_dim, half_to_float = source.args
    if half_to_float:
        return False
    logits_value, picked_value = _value(logits), _value(gather)
    if logits_value is None or picked_value is None or logits_value.dim() != picked_value.dim():
        return False
    dim = dim % logits_value.dim()
    if softmax_dim % logits_value.dim() != dim:
        return False
    with graph.inserting_before(gather):
        picked = graph.call_function(aten.gather.default, (logits, dim, index))
        picked.meta.update(gather.meta)
        total = graph.call_function(aten.logsumexp.default, (logits, [dim], True))
        total.meta.update(source.meta)
        total.meta["val"] = aten.logsumexp.default(logits_value, [dim], True)
        # Each picked entry's own row total, picked the same way (index sizes may be smaller
        # than the logits' outside `dim`, as gather allows).
        rows = graph.call_function(aten.zeros_like.default, (index,))
        rows.meta.update(index.meta)
        totals = graph.call_function(aten.gather.default, (total, dim, rows))
        totals.meta.update(gather.meta)
        difference = graph.call_function(aten.sub.Tensor, (picked, totals))
        difference.meta.update(gather.meta)
    replace_node(gather, difference)
    return True


def _value(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None
