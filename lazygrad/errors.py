"""What lazygrad raises and warns, and how it names the input that eager PyTorch refused."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lazygrad.signature import FlatCall, Signature, TensorMeta, leaf_names, tensor_meta


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
    try:
        args, kwargs = call.rebuild(call.tensors)
    except Exception:  # a structure that cannot be rebuilt: tensors by their number
        names = [f"tensor argument {i}" for i in range(len(call.tensors))]
    else:
        every = leaf_names(args, kwargs, forward)
        names = [every[position] for position in call.tensor_positions]
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
