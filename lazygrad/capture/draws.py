"""Random ops become graph inputs drawn from torch's generator.

ONNX Runtime's random ops ignore `torch.manual_seed`, and a graph that draws inside can never be
rerun with the same draws: a recompute after a missed mask would redraw the Dropout masks and
make the gradients wrong. So every random op of the trace is replaced by a placeholder, and the
runtime draws its value with PyTorch before each forward (reproducible under manual_seed), keeps
it for the backward, and feeds the same value to every graph of that step.
"""

from __future__ import annotations

import dataclasses

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
    """One random input: `torch.rand` or `torch.randn` of a (symbolic) shape and dtype."""

    kind: str  # "rand" or "randn"
    shape: tuple[str, ...]  # size expressions (Python source over the size symbols)
    dtype: str  # name of the torch dtype, e.g. "float32"

    def sample(self, env: dict[str, int], device: torch.device) -> torch.Tensor:
        shape = [int(symbols.evaluate(size, env)) for size in self.shape]
        make = torch.rand if self.kind == "rand" else torch.randn
        return make(shape, dtype=getattr(torch, self.dtype), device=device)


def is_random(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
    )


def lift(gm: fx.GraphModule) -> list[Draw]:
    """Replace each random op of `gm` by a new placeholder `random_<k>` (after the primals).

    Uniform and normal draws become the placeholder itself; a Bernoulli draw of probabilities p
    becomes `uniform < p`. Any other random op cannot be drawn outside and raises CaptureError.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if "tangents" not in n.name]
    anchor = primals[-1] if primals else None
    draws: list[Draw] = []
    for node in list(graph.nodes):
        if not is_random(node):
            continue
        if node.target in _UNIFORM or node.target in _NORMAL:
            kind = "rand" if node.target in _UNIFORM else "randn"
            value = node.meta["val"]
        elif node.target in _BERNOULLI:
            kind = "rand"
            value = node.meta["val"]
        else:
            raise CaptureError(
                f"random op {node.target} cannot be drawn from torch's generator outside the "
                "graph (lazygrad draws rand, randn, bernoulli and dropout)"
            )
        draw = Draw(kind, tuple(symbols.to_code(s) for s in value.shape), _dtype_name(value))
        placeholder = _placeholder(graph, anchor, f"random_{len(draws) + 1}", value)
        anchor = placeholder
        if node.target in _BERNOULLI:
            probability = node.args[1] if node.target is aten.bernoulli.p else node.args[0]
            with graph.inserting_before(node):
                drawn = graph.call_function(aten.lt.Tensor if isinstance(probability, fx.Node)
                                            else aten.lt.Scalar, (placeholder, probability))
                drawn.meta["val"] = value < 0.5
                cast = graph.call_function(aten._to_copy.default, (drawn,),
                                           {"dtype": value.dtype})
                cast.meta["val"] = value
            node.replace_all_uses_with(cast)
        else:
            node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        draws.append(draw)
    if draws:
        graph.lint()
        gm.recompile()
    return draws


def _placeholder(graph: fx.Graph, after: fx.Node | None, name: str, value: torch.Tensor) -> fx.Node:
    if after is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            node = graph.placeholder(name)
    else:
        with graph.inserting_after(after):
            node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def _dtype_name(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")

