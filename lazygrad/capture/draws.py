"""Random ops become graph inputs drawn from torch's generator.

ONNX Runtime's random ops ignore `torch.manual_seed`, and a graph that draws inside can never be
rerun with the same draws: a recompute after a missed mask would redraw the Dropout masks and
make the gradients wrong. So every random op of the trace is replaced by a placeholder, and the
runtime draws its value with PyTorch before each forward, keeps it for the backward, and feeds
the same value to every graph of that step.

Each draw replays the call eager PyTorch's CPU kernel makes, so under the same seed a lazy model
draws what eager draws (and leaves the generator where eager leaves it), in the graph's order,
which is the program's:

- `rand`, `randn`, `randint` (and `_like`), `uniform_`, `normal_`, `exponential_`, `randperm`:
  the same call, of the op's shape, dtype and parameters;
- `bernoulli_(p)` of a float p (Dropout: `empty_like(x).bernoulli_(1 - p)`, then
  `x * (noise / (1 - p))`; `dropout2d`, `alpha_dropout`): the same call;
- `bernoulli(p)` of a probability tensor: `rand < p`, which is what eager's kernel computes;
- `multinomial(probs, n)`: eager's kernel, without replacement (or n == 1), takes the top n of
  `probs / q` with exponential noise `q`; with replacement, it looks float64 uniforms up in the
  normalised cumulative sum: both are written here with the noise drawn outside.

A random op with an explicit `generator=` cannot be replayed from the default generator and
raises CaptureError, as does any other random op (the signature falls back, with the reason).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from lazygrad.capture import symbols
from lazygrad.capture.errors import CaptureError

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Draw:
    """One random input of a (symbolic) shape and dtype, made by one eager call:
    `kind` names it (a key of `_FILLS`), `params` are its scalar arguments, `strides` are
    those of the tensor eager's kernel fills (Python source, as the shape).

    Eager fills in memory order, and the tensor it fills is laid out like the one it is made
    from (`empty_like`): Dropout of a transposed tensor (MultiheadAttention's batch-first
    output, so every nn.TransformerEncoderLayer) draws its mask in the transposed order. A
    contiguous draw put other values at each position: every ORT step dropped other units
    than eager, with no fallback. So the draw fills a tensor of those strides, then hands on
    its values contiguous, as ORT reads them."""

    kind: str
    shape: tuple[str, ...]  # size expressions (Python source over the size symbols)
    dtype: str  # name of the torch dtype, e.g. "float32"
    params: tuple[float, ...] = ()
    strides: tuple[str, ...] = ()  # () for a new contiguous tensor

    def sample(self, env: dict[str, int], device: torch.device,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """The draw, from `generator` (None: torch's default one on `device`)."""
        shape = [int(symbols.evaluate(size, env)) for size in self.shape]
        dtype = getattr(torch, self.dtype)
        if self.kind == "randperm":
            return torch.randperm(shape[0], dtype=dtype, device=device, generator=generator)
        strides = [int(symbols.evaluate(stride, env)) for stride in self.strides]
        tensor = (torch.empty_strided(shape, strides, dtype=dtype, device=device) if strides
                  else torch.empty(shape, dtype=dtype, device=device))
        return _FILLS[self.kind](tensor, *self.params, generator=generator).contiguous()


# In place, as eager's random factories fill a new tensor (`rand` is `empty().uniform_(0, 1)`).
_FILLS = {
    "rand": lambda tensor, generator: tensor.uniform_(0, 1, generator=generator),
    "randn": lambda tensor, generator: tensor.normal_(0, 1, generator=generator),
    "uniform": lambda tensor, low, high, generator: tensor.uniform_(low, high,
                                                                    generator=generator),
    "normal": lambda tensor, mean, std, generator: tensor.normal_(mean, std,
                                                                  generator=generator),
    "exponential": lambda tensor, rate, generator: tensor.exponential_(rate,
                                                                       generator=generator),
    "bernoulli": lambda tensor, p, generator: tensor.bernoulli_(p, generator=generator),
    "randint": lambda tensor, low, high, generator: tensor.random_(int(low), int(high),
                                                                   generator=generator),
}

# op -> (draw kind, its parameters from the op's arguments): the node becomes the draw itself
_DIRECT = {
    aten.rand.default: ("rand", lambda args, kwargs: ()),
    aten.rand_like.default: ("rand", lambda args, kwargs: ()),
    aten.randn.default: ("randn", lambda args, kwargs: ()),
    aten.randn_like.default: ("randn", lambda args, kwargs: ()),
    aten.uniform.default: ("uniform", lambda args, kwargs: (
        _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0))),
    aten.normal_functional.default: ("normal", lambda args, kwargs: (
        _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0))),
    aten.normal.float_float: ("normal", lambda args, kwargs: (
        _arg(args, kwargs, 0, "mean", 0.0), _arg(args, kwargs, 1, "std", 1.0))),
    aten.exponential.default: ("exponential", lambda args, kwargs: (
        _arg(args, kwargs, 1, "lambd", 1.0),)),
    aten.bernoulli.p: ("bernoulli", lambda args, kwargs: (_arg(args, kwargs, 1, "p", 0.5),)),
    aten.randint.default: ("randint", lambda args, kwargs: (0, args[0])),
    aten.randint.low: ("randint", lambda args, kwargs: (args[0], args[1])),
    aten.randint_like.default: ("randint", lambda args, kwargs: (
        0, _arg(args, kwargs, 1, "high", 0))),
    aten.randint_like.low_dtype: ("randint", lambda args, kwargs: (
        _arg(args, kwargs, 1, "low", 0), _arg(args, kwargs, 2, "high", 0))),
    aten.randperm.default: ("randperm", lambda args, kwargs: ()),
}
_BERNOULLI_OF_TENSOR = {aten.bernoulli.default, aten.bernoulli.Tensor}
# normal of a tensor mean or std: eager draws normal_(0, std) and adds the mean, or normal_(0, 1)
# and scales it by the std first
_NORMAL_OF_TENSOR = {aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor}
NOT_DECOMPOSED = [aten.exponential.default, aten.uniform.default]
"""Random ops the trace must keep whole (torch decomposes them into `rand_like`, which draws
other numbers than eager's kernel)."""


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: float) -> float:
    value = args[index] if len(args) > index else kwargs.get(name, default)
    if isinstance(value, fx.Node):
        raise CaptureError(f"a random op's parameter {name} is a tensor")
    return value


def is_random(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
    )


def lift(gm: fx.GraphModule) -> list[Draw]:
    """Replace each random op of `gm` by a new placeholder `random_<k>` (after the primals) and
    the ops that make the random op's value from it. Raises CaptureError for a random op that
    cannot be drawn outside the graph."""
    graph = gm.graph
    primals = [n for n in graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
    anchor = primals[-1] if primals else None
    draws: list[Draw] = []
    for node in list(graph.nodes):
        if not is_random(node):
            continue
        if node.kwargs.get("generator") is not None:
            raise CaptureError(
                f"random op {node.target} draws from a generator of its own, which lazygrad "
                "cannot replay from torch's default generator"
            )
        draw, value = _draw_of(node)
        anchor = placeholder = _placeholder(graph, anchor, f"random_{len(draws) + 1}", value)
        with graph.inserting_before(node):
            if node.target is aten.native_dropout.default:
                _replace_dropout(graph, node, placeholder)
            elif node.target in _BERNOULLI_OF_TENSOR:
                _replace_bernoulli(graph, node, placeholder)
            elif node.target is aten.multinomial.default:
                _replace_multinomial(graph, node, placeholder)
            elif node.target in _NORMAL_OF_TENSOR:
                _replace_normal(graph, node, placeholder)
            else:
                node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        draws.append(draw)
    if draws:
        graph.lint()
        gm.recompile()
    return draws


def _draw_of(node: fx.Node) -> tuple[Draw, torch.Tensor]:
    """The draw that replaces `node`, and the (fake) value of its placeholder."""
    value = node.meta["val"]
    if node.target in _DIRECT:
        kind, params = _DIRECT[node.target]
        return Draw(kind, _shape(value), _dtype_name(value), params(node.args, node.kwargs),
                    _strides(value)), value
    if node.target is aten.native_dropout.default:
        return _dropout_draw(node)
    if node.target in _BERNOULLI_OF_TENSOR:
        return Draw("rand", _shape(value), _dtype_name(value), (), _strides(value)), value
    if node.target is aten.multinomial.default:
        return _multinomial_draw(node)
    if node.target in _NORMAL_OF_TENSOR:
        std = node.args[1] if node.target is aten.normal.Tensor_float else 1.0
        return Draw("normal", _shape(value), _dtype_name(value), (0.0, std),
                    _strides(value)), value
    raise CaptureError(
        f"random op {node.target} cannot be drawn from torch's generator outside the graph "
        f"(lazygrad draws {', '.join(sorted(_FILLS))}, randperm, dropout and multinomial)"
    )


def _dropout_draw(node: fx.Node) -> tuple[Draw, torch.Tensor]:
    source, p, train = node.args
    value = source.meta["val"]
    if not train:  # eval-mode native_dropout draws nothing; it never reaches a trace as random
        raise CaptureError("native_dropout with train=False in a trace")
    return Draw("bernoulli", _shape(value), _dtype_name(value), (1.0 - p,),
                _strides(torch.empty_like(value))), value


def _replace_dropout(graph: fx.Graph, node: fx.Node, noise: fx.Node) -> None:
    """(output, mask) of native_dropout -> (x * (noise / (1 - p)), noise > 0), as eager's CPU
    kernel computes it."""
    source, p, _ = node.args
    keep = 1.0 - p
    scaled = _call(graph, aten.div.Scalar, (noise, keep), noise.meta["val"])
    output = _call(graph, aten.mul.Tensor, (source, scaled), source.meta["val"])
    mask = _call(graph, aten.gt.Scalar, (noise, 0), noise.meta["val"] > 0)
    _replace_items(graph, node, [output, mask])


def _replace_bernoulli(graph: fx.Graph, node: fx.Node, uniform: fx.Node) -> None:
    probability = node.args[1] if node.target is aten.bernoulli.Tensor else node.args[0]
    value = node.meta["val"]
    drawn = _call(graph, aten.lt.Tensor, (uniform, probability), value < 0.5)
    cast = _call(graph, aten._to_copy.default, (drawn,), value, {"dtype": value.dtype})
    node.replace_all_uses_with(cast)


def _with_replacement(node: fx.Node) -> bool:
    """multinomial's kernel draws with replacement only where it matters (more than one)."""
    replacement = node.args[2] if len(node.args) > 2 else node.kwargs.get("replacement", False)
    return bool(replacement) and node.args[1] > 1


def _replace_normal(graph: fx.Graph, node: fx.Node, noise: fx.Node) -> None:
    mean, std = node.args[0], node.args[1]
    value = node.meta["val"]
    if node.target is not aten.normal.Tensor_float:
        mul = aten.mul.Tensor if isinstance(std, fx.Node) else aten.mul.Scalar
        noise = _call(graph, mul, (noise, std), value)
    add = aten.add.Tensor if isinstance(mean, fx.Node) else aten.add.Scalar
    node.replace_all_uses_with(_call(graph, add, (noise, mean), value))


def _multinomial_draw(node: fx.Node) -> tuple[Draw, torch.Tensor]:
    value = node.args[0].meta["val"]
    if _with_replacement(node):  # one float64 uniform per sample, row after row
        noise = node.meta["val"].to(torch.float64)
        return Draw("rand", _shape(noise), "float64"), noise
    return Draw("exponential", _shape(value), _dtype_name(value), (1.0,),
                _strides(torch.empty_like(value))), value


def _replace_multinomial(graph: fx.Graph, node: fx.Node, noise: fx.Node) -> None:
    probs, samples = node.args[0], node.args[1]
    index = node.meta["val"]
    if _with_replacement(node):  # the number of cumulative probabilities below each uniform
        p = probs.meta["val"]
        wide = _call(graph, aten._to_copy.default, (probs,), p.to(torch.float64),
                     {"dtype": torch.float64})
        cumulative = _call(graph, aten.cumsum.default, (wide, -1), wide.meta["val"])
        last = cumulative.meta["val"][..., -1:]
        total = _call(graph, aten.slice.Tensor, (cumulative, -1, -1), last)
        cdf = _call(graph, aten.div.Tensor, (cumulative, total), cumulative.meta["val"])
        u = _call(graph, aten.unsqueeze.default, (noise, -1), noise.meta["val"][..., None])
        c = _call(graph, aten.unsqueeze.default, (cdf, -2), cdf.meta["val"][..., None, :])
        above = _call(graph, aten.gt.Tensor, (u, c), u.meta["val"] > c.meta["val"])
        below = _call(graph, aten.sum.dim_IntList, (above, [-1]), index,
                      {"dtype": torch.int64})
        node.replace_all_uses_with(below)
        return
    q = _call(graph, aten.div.Tensor, (probs, noise), noise.meta["val"])
    top = _call(graph, aten.topk.default, (q, samples), torch.topk(q.meta["val"], samples))
    picked = _call(graph, operator.getitem, (top, 1), index)
    node.replace_all_uses_with(picked)


def _replace_items(graph: fx.Graph, node: fx.Node, items: list[fx.Node]) -> None:
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(items[user.args[1]])
            graph.erase_node(user)


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


def _strides(value: torch.Tensor) -> tuple[str, ...]:
    """The strides of the tensor eager's kernel fills (its output, or `empty_like` of the
    tensor it is made from, a fake tensor of the trace like every `value` here)."""
    return tuple(symbols.to_code(stride) for stride in value.stride())


def _dtype_name(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")
