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

Both compute the same values as the ops they replace (not a gradient: derivatives come from
the partition before), and the check (`verify.py`) runs the rewritten FX graph against ORT.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


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
                or not _same(result.shape, shaped.shape)
                or not _same(bias_value.shape, product_value.shape[-1:])
                or not _same(shaped.shape[-1:], product_value.shape[-1:])):
            continue
        with graph.inserting_before(add):
            fused = graph.call_function(aten.addmm.default, (bias, *product.args))
            fused.meta.update(product.meta)
            if view is not None:
                fused = graph.call_function(view.target, (fused, *view.args[1:]))
                fused.meta.update(view.meta)
        fused.meta["val"] = result
        add.replace_all_uses_with(fused)
        graph.erase_node(add)
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
    gather.replace_all_uses_with(difference)
    graph.erase_node(gather)
    return True


def _same(a, b) -> bool:
    """Two shapes are equal, symbol for symbol (comparing SymInts would add guards)."""
    return [str(x) for x in a] == [str(x) for x in b]


def _value(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None
