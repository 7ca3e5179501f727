"""What lazygrad raises and warns, and how it names the input that eager PyTorch refused."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from lazygrad.signature import FlatCall, Signature, TensorMeta, tensor_meta


class LazygradError(RuntimeError):
    """Raised in strict mode where the runtime would otherwise fall back to eager PyTorch."""


class FallbackWarning(UserWarning):
    """A signature of a lazy module runs in eager PyTorch (the reason is in the message)."""


class GraphBreakWarning(FallbackWarning):
    """A signature of a lazy module cannot be captured whole: its own forward runs in eager
    PyTorch and its submodules through ORT, each on its own (the reason is in the message)."""


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
