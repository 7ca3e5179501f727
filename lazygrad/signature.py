"""Flatten a call's arguments and key it: what decides whether a captured graph can be reused.

A graph captured for one call serves another call when the two agree on the modules' plain
attributes (train/eval flags among them), grad mode, the autocast state, the structure of the
arguments, every tensor's dtype, rank, device, requires_grad, which of its sizes are 0 or 1
and its layout (contiguous, or the order of its strides), every non-tensor argument's value,
and the parameters' dtypes, shapes, devices, requires_grad and layouts. Its other sizes are
`shapes`, which the runtime fills in per call (`sizes_for`): at first the exact sizes of the
first call, as torch.compile specialises a first compilation (a trace with every size a
symbol took Swin's window arithmetic 174 s, against seconds for exact sizes); a size that a
later call changes becomes a symbol from then on, so one graph serves every batch size and
sequence length after the first change. The conditions a trace put on its symbols are checked
per call (`GraphPair.holds_for`); a call that breaks them gets a graph for its exact sizes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import operator
import threading
import types
from collections.abc import Callable, Collection, Hashable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

# Non-tensor argument leaves a graph may be specialised on: values, and code (a function is
# kept by identity). Any other object (a Hugging Face `DynamicCache`, an array, a module) can
# hold tensors the trace would bake in as constants, and state the forward changes (a cache
# appends each call's keys) that ORT's steps would never change: `opaque_leaf`.
VALUES = (
    type(None), bool, int, float, complex, str, bytes, type, enum.Enum, slice, type(Ellipsis),
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
    types.FunctionType, types.BuiltinFunctionType,
)


class TensorMeta(NamedTuple):
    dtype: torch.dtype
    ndim: int
    device: torch.device
    requires_grad: bool
    # Sizes 0 and 1 are traced as constants (a size-1 dimension broadcasts), others as symbols:
    # which dimensions are 0 or 1 is part of the key (-1 stands for "2 or more").
    small_sizes: tuple[int, ...]
    # () if contiguous, else the dimensions from the largest stride to the smallest: eager's
    # random draws fill tensors laid out like the input (Dropout after a channels-last
    # convolution), so a graph's draws hold for the layouts it was traced with (`Draw`).
    layout: tuple[int, ...] = ()


# A state tensor's part of the key: (dtype, shape, device, requires_grad), read in one C call.
StateMeta = tuple[torch.dtype, torch.Size, torch.device, bool]
state_meta = operator.attrgetter("dtype", "shape", "device", "requires_grad")


@dataclasses.dataclass(frozen=True)
class Signature:
    modes: tuple  # plain attributes of every submodule, its train/eval flag among them
    grad: bool  # autograd records this call (grad mode on and something requires grad)
    autocast: tuple[tuple[str, bool, torch.dtype | None], ...]  # the trace records its casts
    default_dtype: torch.dtype  # of the tensors the forward makes (`torch.zeros(n)`)
    structure: pytree.TreeSpec
    tensors: tuple[TensorMeta, ...]
    constants: tuple[Hashable, ...]
    state: tuple[StateMeta, ...]
    state_layouts: tuple[tuple[int, ...], ...]  # () while every state tensor is contiguous
    # per call tensor, each size: the int the graphs are specialised on, or None for a symbol
    shapes: tuple[tuple[int | None, ...], ...] | None = None

    def __post_init__(self) -> None:
        # A signature is hashed by every cache lookup of a call: once is enough.
        fields = (self.modes, self.grad, self.autocast, self.default_dtype, self.structure,
                  self.tensors, self.constants, self.state, self.state_layouts, self.shapes)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def with_shapes(self, shapes: tuple[tuple[int | None, ...], ...] | None) -> Signature:
        return dataclasses.replace(self, shapes=shapes)

    @property
    def half_precision(self) -> bool:
        """Whether it computes in bfloat16 or float16: autocast to one, or a tensor of one."""
        halves = (torch.bfloat16, torch.float16)
        return (any(enabled and dtype in halves for _, enabled, dtype in self.autocast)
                or any(t.dtype in halves for t in self.tensors)
                or any(s[0] in halves for s in self.state))

    @property
    def dynamic_dims(self) -> list[list[bool]]:
        """Per call tensor, which of its sizes are symbols."""
        assert self.shapes is not None
        return [[size is None for size in sizes] for sizes in self.shapes]


def exact_shapes(tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors)


def sizes_for(known: tuple[tuple[int | None, ...], ...] | None,
              shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int | None, ...], ...]:
    """The sizes a signature's graphs are specialised on, given those known so far (None: this
    is its first call) and this call's `shapes`: `known` if the call fits it, else with the
    sizes it differs in made symbols."""
    if known is None:
        return shapes
    if shapes == known or all(k is None or k == s for ks, ss in zip(known, shapes)
                              for k, s in zip(ks, ss)):
        return known
    return tuple(tuple(k if k == s else None for k, s in zip(ks, ss))
                 for ks, ss in zip(known, shapes))


@dataclasses.dataclass
class FlatCall:
    """One call's arguments, split into tensor leaves and everything else."""

    leaves: list[Any]
    structure: pytree.TreeSpec
    tensor_positions: list[int]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_positions]

    def without_tensors(self) -> FlatCall:
        """The call's structure and constants, holding none of its tensors."""
        leaves = list(self.leaves)
        for position in self.tensor_positions:
            leaves[position] = None
        return FlatCall(leaves, self.structure, self.tensor_positions)

    def rebuild(self, tensors: list[Any]) -> tuple[tuple, dict]:
        """The (args, kwargs) of the call with its tensor leaves replaced by `tensors`."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.structure)


def flatten_call(args: tuple, kwargs: dict, named: Collection[str] = ()) -> FlatCall:
    """The call's leaves and structure; `named`: the keywords the forward names (`named_keywords`),
    whose order does not change the key."""
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
        # The common call, `model(*tensors)`: its structure depends on the count alone.
        return FlatCall(list(args), _tensors_structure(len(args)), list(range(len(args))))
    leaves, structure = flatten((args, keywords_in_order(kwargs, named)))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return FlatCall(leaves, structure, positions)


def keywords_in_order(kwargs: dict, named: Collection[str]) -> dict:
    """The call's keywords in the key's order: those the forward names, sorted (Python binds
    them by name, so their order changes nothing), then the others, which its `**kwargs`
    receives, in the caller's order (a forward that iterates them sees it)."""
    ordered = {name: kwargs[name] for name in sorted(kwargs) if name in named}
    ordered.update((name, value) for name, value in kwargs.items() if name not in named)
    return ordered


@functools.cache
def named_keywords(forward: Callable[..., Any]) -> frozenset[str]:
    """The parameters of `forward` a keyword argument binds by name."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def opaque_leaf(call: FlatCall) -> int | None:
    """The position of the first argument leaf that is neither a tensor nor one of `VALUES` (a
    `DynamicCache`), or None. Such a call cannot be captured: the trace would bake what the
    object holds into the graph and change the caller's object with trace tensors, so it is
    refused before any trace runs."""
    if len(call.tensor_positions) == len(call.leaves):
        return None
    for position, leaf in enumerate(call.leaves):
        if not isinstance(leaf, (torch.Tensor, *VALUES)):
            return position
    return None


def leaf_names(args: tuple, kwargs: dict, forward: Callable[..., Any]) -> list[str]:
    """A readable name for each of the call's leaves (`flatten_call`'s order): "argument 0
    ('x')", "argument 'mask'[1]". `forward` (unbound) names the positional arguments."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # drop self
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = keywords_in_order(kwargs, named_keywords(forward))
    try:
        paths = [path for path, _ in
                 pytree.tree_flatten_with_path((args, kwargs))[0]]
    except Exception:  # a pytree node type registered without key paths
        count = len(flatten((args, kwargs))[0])
        return [f"argument leaf {i}" for i in range(count)]
    names = []
    for path in paths:
        rest = pytree.keystr(path[2:])
        if path[0].idx == 0:  # a positional argument
            index = path[1].idx
            name = f" ({positional[index]!r})" if index < len(positional) else ""
            names.append(f"argument {index}{name}{rest}")
        else:
            names.append(f"argument {path[1].key!r}{rest}")
    return names


@functools.cache
def _tensors_structure(count: int) -> pytree.TreeSpec:
    return pytree.tree_flatten(((0,) * count, {}))[1]


_registration_lock = threading.Lock()


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """`pytree.tree_flatten`, also descending into dataclass instances.

    Tuples, lists, dicts, namedtuples and `None` are pytree nodes already; a dataclass is not, and
    as a leaf its tensors would be invisible (baked into the graph as a constant). Each dataclass
    type met is therefore registered once with `torch.utils._pytree.register_dataclass` (a
    process-wide registration, as `torch.export` does for its inputs); its `init` fields become
    children, so it is rebuilt by calling the class with them.
    """
    while True:
        leaves, structure = pytree.tree_flatten(tree)
        unregistered = {
            type(leaf) for leaf in leaves
            if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
        }
        if not unregistered:
            return leaves, structure
        with _registration_lock:
            for cls in unregistered:
                if cls not in pytree.SUPPORTED_NODES:
                    pytree.register_dataclass(cls)


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(
        tensor.dtype,
        tensor.dim(),
        tensor.device,
        tensor.requires_grad,
        tuple(size if size < 2 else -1 for size in tensor.shape),
        () if tensor.is_contiguous() else _stride_order(tensor),
    )


def _stride_order(tensor: torch.Tensor) -> tuple[int, ...]:
    strides = tensor.stride()
    return tuple(sorted(range(len(strides)), key=lambda dim: -strides[dim]))


def signature_of(call: FlatCall, state: dict[str, torch.Tensor], modes: tuple) -> Signature:
    return Signature(*_parts(call, state, modes))


class LastSignature:
    """One module's last signature, returned again while none of its parts changed.

    A training loop calls with one signature step after step. A new `Signature` costs hashing
    its modes and argument structure, and then each cache lookup compares it field by field;
    instead this call's parts (dtypes, shapes, devices, requires_grad, grad mode, autocast,
    default dtype, constants: everything a signature holds) are compared with the last
    call's, the modes and the structure by identity first (`ModuleState` and `flatten_call`
    hand back the same objects while unchanged), and the last object is returned, so lookups
    hit on identity.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple, Signature] | None = None

    def of(self, call: FlatCall, state: dict[str, torch.Tensor], modes: tuple) -> Signature:
        parts = _parts(call, state, modes)
        last = self._last
        if last is not None and last[0] == parts:
            return last[1]
        signature = Signature(*parts)
        self._last = (parts, signature)
        return signature


def _parts(call: FlatCall, state: dict[str, torch.Tensor], modes: tuple) -> tuple:
    """The fields of the call's `Signature`, in order (`shapes` left out)."""
    leaves = call.leaves
    constants = () if len(call.tensor_positions) == len(leaves) else tuple(
        _hashable(leaf, i) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)
    )
    tensors = tuple(map(tensor_meta, call.tensors))
    states = tuple(map(state_meta, state.values()))
    grad = torch.is_grad_enabled() and (
        any(map(_requires_grad, tensors)) or any(map(_requires_grad, states))
    )
    return (modes, grad, _autocast(), torch.get_default_dtype(), call.structure, tensors,
            constants, states, _layouts(state.values()))


_requires_grad = operator.itemgetter(3)  # of a TensorMeta and of a state's meta
_contiguous = operator.methodcaller("is_contiguous")


def _layouts(tensors: Collection[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """The state tensors' layouts, as `TensorMeta.layout`: a model converted to channels-last
    after its first build draws its Dropout masks in the new layout (`Draw`). () in one pass
    while all are contiguous, as they nearly always are."""
    if all(map(_contiguous, tensors)):
        return ()
    return tuple(() if t.is_contiguous() else _stride_order(t) for t in tensors)


def _autocast() -> tuple[tuple[str, bool, torch.dtype | None], ...]:
    """Per device: whether autocast is on, and its dtype (None while off: not traced then)."""
    cpu, cuda = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")
    return (
        ("cpu", cpu, torch.get_autocast_dtype("cpu") if cpu else None),
        ("cuda", cuda, torch.get_autocast_dtype("cuda") if cuda else None),
    )


def _hashable(value: Any, position: int) -> Hashable:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"lazygrad: argument leaf {position} of type {type(value).__name__} is neither a "
            "tensor nor hashable; non-tensor arguments are baked into the exported graph and "
            "must be hashable so the graph can be looked up again"
        ) from None
    if type(value) is float:  # -0.0 == 0.0, and a forward may tell them apart (copysign)
        return (float, (value, math.copysign(1.0, value)))
    return (type(value), value)

