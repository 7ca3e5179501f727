"""Flatten a call's arguments and key it: what decides whether an exported graph can be reused.

A graph exported for one call serves another call when the two agree on the train/eval flags and
the autocast state, on the structure of the arguments, on every tensor's dtype, rank, device and
requires_grad, on every non-tensor argument's value, and on the parameters' dtypes, devices and
requires_grad. Sizes are
not part of the key: graphs are exported with dynamic axes (see `export.py`), unless the trace
showed that sizes were baked in, in which case the runtime adds them (`with_shapes`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree


class TensorMeta(NamedTuple):
    dtype: torch.dtype
    ndim: int
    device: torch.device
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Signature:
    modes: tuple[bool, ...]  # train/eval flag of every submodule
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # the trace records autocast's casts
    structure: pytree.TreeSpec
    tensors: tuple[TensorMeta, ...]
    constants: tuple[Hashable, ...]
    state: tuple[TensorMeta, ...]
    shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        # A signature is hashed by every cache lookup of a call: once is enough.
        fields = (self.modes, self.autocast, self.structure, self.tensors, self.constants,
                  self.state, self.shapes)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def with_shapes(self, tensors: list[torch.Tensor]) -> Signature:
        return dataclasses.replace(self, shapes=tuple(tuple(t.shape) for t in tensors))


@dataclasses.dataclass
class FlatCall:
    """One call's arguments, split into tensor leaves and everything else."""

    leaves: list[Any]
    structure: pytree.TreeSpec
    tensor_positions: list[int]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_positions]

    def rebuild(self, tensors: list[Any]) -> tuple[tuple, dict]:
        """The (args, kwargs) of the call with its tensor leaves replaced by `tensors`."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.structure)


def flatten_call(args: tuple, kwargs: dict) -> FlatCall:
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
        # The common call, `model(*tensors)`: its structure depends on the count alone.
        return FlatCall(list(args), _tensors_structure(len(args)), list(range(len(args))))
    # Keyword order does not change a Python call's meaning, so it does not change the key.
    leaves, structure = flatten((args, dict(sorted(kwargs.items()))))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return FlatCall(leaves, structure, positions)


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
    return TensorMeta(tensor.dtype, tensor.dim(), tensor.device, tensor.requires_grad)


def signature_of(
    call: FlatCall, state: dict[str, torch.Tensor], modes: tuple[bool, ...]
) -> Signature:
    constants = tuple(
        _hashable(leaf, i)
        for i, leaf in enumerate(call.leaves)
        if not isinstance(leaf, torch.Tensor)
    )
    return Signature(
        modes=modes,
        autocast=tuple(
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
        ),
        structure=call.structure,
        tensors=tuple(tensor_meta(t) for t in call.tensors),
        constants=constants,
        state=tuple(tensor_meta(t) for t in state.values()),
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
    return (type(value), value)
