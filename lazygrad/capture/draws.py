"""Random ops become graph inputs drawn from torch's generator.

ONNX Runtime's random ops ignore `torch.manual_seed`, and a graph that draws inside can never be
rerun with the same draws: a recompute after a missed mask would redraw the Dropout masks and
make the gradients wrong. So every random op of the trace is replaced by a placeholder, and the
runtime draws its value with PyTorch before each forward, keeps it for the backward, and feeds
the same value to every graph of that step.

Dropout is drawn as eager PyTorch's CPU kernel draws it (`empty_like(x).bernoulli_(1 - p)`, then
`x * (noise / (1 - p))`), so under the same seed a lazy model drops the same units as eager.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from lazygrad.capture import symbols
from lazygrad.capture.errors import CaptureError

aten = torch.ops.aten

_UNIFORM = {aten.rand.default, aten.rand_like.default}
_NORMAL = {aten.randn.default, aten.randn_like.default}
_BERNOULLI = {aten.bernoulli.default, aten.bernoulli.p}


@dataclasses.dataclass(frozen=True)
class Draw:
    """One random input of a (symbolic) shape and dtype: `torch.rand`, `torch.randn`, or a
    Bernoulli noise of probability `probability` (Dropout's keep mask)."""

    kind: str  # "rand", "randn" or "bernoulli"
    shape: tuple[str, ...]  # size expressions (Python source over the size symbols)
    dtype: str  # name of the torch dtype, e.g. "float32"
    probability: float = 0.0  # of a one, for "bernoulli"

    def sample(self, env: dict[str, int], device: torch.device) -> torch.Tensor:
        shape = [int(symbols.evaluate(size, env)) for size in self.shape]
        dtype = getattr(torch, self.dtype)
        if self.kind == "bernoulli":
            return torch.empty(shape, dtype=dtype, device=device).bernoulli_(self.probability)
        make = torch.rand if self.kind == "rand" else torch.randn
        return make(shape, dtype=dtype, device=device)


def is_random(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
    )


def lift(gm: fx.GraphModule) -> list[Draw]:
    """Replace each random op of `gm` by a new placeholder `random_<k>` (after the primals).

    Uniform and normal draws become the placeholder itself; a Bernoulli draw of probabilities p
    becomes `uniform < p`; Dropout becomes its noise placeholder times the input. Any other
    random op cannot be drawn outside and raises CaptureError.
    """
    graph = gm.graph
    primals = [n for n in graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
    anchor = primals[-1] if primals else None
    draws: list[Draw] = []
    for node in list(graph.nodes):
        if not is_random(node):
            continue
        if node.target is aten.native_dropout.default:
            draw, value = _dropout_draw(node)
        elif node.target in _UNIFORM or node.target in _NORMAL or node.target in _BERNOULLI:
            value = node.meta["val"]
            kind = "randn" if node.target in _NORMAL else "rand"
            draw = Draw(kind, _shape(value), _dtype_name(value))
        else:
            raise CaptureError(
                f"random op {node.target} cannot be drawn from torch's generator outside the "
                "graph (lazygrad draws rand, randn, bernoulli and dropout)"
            )
        anchor = placeholder = _placeholder(graph, anchor, f"random_{len(draws) + 1}", value)
        with graph.inserting_before(node):
            if node.target is aten.native_dropout.default:
                _replace_dropout(graph, node, placeholder)
            elif node.target in _BERNOULLI:
                _replace_bernoulli(graph, node, placeholder)
            else:
                node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        draws.append(draw)
    if draws:
        graph.lint()
        gm.recompile()
    return draws


def _dropout_draw(node: fx.Node) -> tuple[Draw, torch.Tensor]:
    source, p, train = node.args
    value = source.meta["val"]
    if not train:  # eval-mode native_dropout draws nothing; it never reaches a trace as random
        raise CaptureError("native_dropout with train=False in a trace")
    return Draw("bernoulli", _shape(value), _dtype_name(value), 1.0 - p), value


def _replace_dropout(graph: fx.Graph, node: fx.Node, noise: fx.Node) -> None:
    """(output, mask) of native_dropout -> (x * (noise / (1 - p)), noise > 0), as eager's CPU
    kernel computes it."""
    source, p, _ = node.args
    keep = 1.0 - p
    scaled = _call(graph, aten.div.Scalar, (noise, keep), noise.meta["val"])
    output = _call(graph, aten.mul.Tensor, (source, scaled), source.meta["val"])
    mask = _call(graph, aten.gt.Scalar, (noise, 0), noise.meta["val"] > 0)
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(output if user.args[1] == 0 else mask)
            graph.erase_node(user)


def _replace_bernoulli(graph: fx.Graph, node: fx.Node, uniform: fx.Node) -> None:
    probability = node.args[1] if node.target is aten.bernoulli.p else node.args[0]
    compare = aten.lt.Tensor if isinstance(probability, fx.Node) else aten.lt.Scalar
    value = node.meta["val"]
    drawn = _call(graph, compare, (uniform, probability), value < 0.5)
    cast = _call(graph, aten._to_copy.default, (drawn,), value, {"dtype": value.dtype})
    node.replace_all_uses_with(cast)


def _call(graph: fx.Graph, target, args: tuple, value: object, kwargs: dict | None = None):
    made = graph.call_function(target, args, kwargs or {})
    made.meta["val"] = value
    return made


def _placeholder(graph: fx.Graph, after: fx.Node | None, name: str, value: torch.Tensor) -> fx.Node:
    if after is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            node = graph.placeholder(name)
    else:
        with graph.inserting_after(after):
            node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def _shape(value: torch.Tensor) -> tuple[str, ...]:
    return tuple(symbols.to_code(size) for size in value.shape)


def _dtype_name(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")
