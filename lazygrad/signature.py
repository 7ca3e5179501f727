"""Flatten a call's arguments and key it: what decides whether an exported graph can be reused.

A graph exported for one call serves another call when the two agree on the train/eval flags, on the
structure of the arguments, on every tensor's dtype, rank, device and requires_grad, on every
non-tensor argument's value, and on the parameters' dtypes, devices and requires_grad. Sizes are
not part of the key: graphs are exported with dynamic axes (see `export.py`), unless the trace
showed that sizes were baked in, in which case the runtime adds them (`with_shapes`).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    ndim: int
    device: torch.device
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Signature:
    modes: tuple[bool, ...]  # train/eval flag of every submodule
    structure: pytree.TreeSpec
    tensors: tuple[TensorMeta, ...]
    constants: tuple[Hashable, ...]
    state: tuple[TensorMeta, ...]
    shapes: tuple[tuple[int, ...], ...] | None = None

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
    # Keyword order does not change a Python call's meaning, so it does not change the key.
    leaves, structure = flatten((args, dict(sorted(kwargs.items()))))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return FlatCall(leaves, structure, positions)


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


def explain_bad_input(
    error: Exception,
    call: FlatCall,
    forward: Callable,
    known: list[Signature],
    state: dict[str, torch.Tensor],
) -> Exception | None:
    """`error` (eager PyTorch's, for a call it could not run) with the culprit input named.

    Only called once eager PyTorch has failed on the call too: a new dtype, device or rank is a
    new signature (a new export) when eager accepts it, and an error only when eager does not.
    The call's tensors are compared with the most recent exported signature of the same argument
    structure ("as exported"); with none, floating-point inputs are compared with the module's
    parameters. The result has `error`'s type (so `except RuntimeError` still catches it) and a
    message such as "lazygrad: argument 0 ('x'): expected dtype torch.float32 (as exported), got
    torch.float64", followed by eager's message. None when nothing differs (eager's error, which
    already names the problem, is then raised as it is) or the type cannot take a message.
    """
    names = _leaf_names(call, forward)
    problems: list[str] = []
    got = [tensor_meta(t) for t in call.tensors]
    candidates = [
        _differences(names, got, s.tensors) for s in known if s.structure == call.structure
    ]
    if candidates:
        problems = min(reversed(candidates), key=len)  # the closest; the most recent on ties
    else:
        floats = [t for t in state.values() if t.is_floating_point()]
        if floats:
            for name, tensor in zip(names, call.tensors):
                if tensor.device != floats[0].device:
                    problems.append(
                        f"{name}: expected device {floats[0].device} (the module's parameters), "
                        f"got {tensor.device}"
                    )
                elif tensor.is_floating_point() and tensor.dtype != floats[0].dtype:
                    problems.append(
                        f"{name}: expected dtype {floats[0].dtype} (the module's parameters), "
                        f"got {tensor.dtype}"
                    )
    if not problems:
        return None
    message = "lazygrad: " + "; ".join(problems) + f". Eager PyTorch fails too: {error}"
    try:
        explained = type(error)(message)
    except Exception:  # an exception type whose constructor wants more than a message
        return None
    return explained if str(explained) == message else None


def _differences(
    names: list[str], got: list[TensorMeta], exported: tuple[TensorMeta, ...]
) -> list[str]:
    problems = []
    for name, have, want in zip(names, got, exported):
        for what, label in (("dtype", "dtype"), ("device", "device"), ("ndim", "rank")):
            if getattr(have, what) != getattr(want, what):
                problems.append(
                    f"{name}: expected {label} {getattr(want, what)} (as exported), "
                    f"got {getattr(have, what)}"
                )
    return problems


def _leaf_names(call: FlatCall, forward: Callable) -> list[str]:
    """A readable name for each tensor of the call: "argument 0 ('x')", "argument 'mask'[1]"."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # drop self
    except (TypeError, ValueError):
        parameters = []
    positional = [
        p.name for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    try:
        args, kwargs = call.rebuild(call.tensors)
        paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
    except Exception:  # a pytree node type registered without key paths
        return [f"tensor argument {i}" for i in range(len(call.tensors))]
    names = []
    for position in call.tensor_positions:
        path = paths[position]
        rest = pytree.keystr(path[2:])
        if path[0].idx == 0:  # a positional argument
            index = path[1].idx
            name = f" ({positional[index]!r})" if index < len(positional) else ""
            names.append(f"argument {index}{name}{rest}")
        else:
            names.append(f"argument {path[1].key!r}{rest}")
    return names
