"""Forward hooks of the user's that run for what they do in Python: ORT steps would skip them.

A forward hook or pre-hook on a submodule runs once, in the trace; ORT steps run no Python. A
hook that changes the output (returns a value) or computes with its tensors (Hugging Face's
output recorders, a collector the forward returns) is traced into the graph with the rest; one
that keeps a traced tensor is caught by `escapes.py`. A hook that returns nothing and computes
nothing runs for its Python side effects: a call counter, a shape or FLOP counter adding up
Python numbers, a timer. Traced, it ran once for a whole training, with no sign of it. So a hook
whose code is the user's (outside the installed libraries) that returns nothing and runs no
tensor op while traced makes the module run in parts: each hooked submodule, called by eager
PyTorch, fires its hooks around its own lazy call at every step, as in eager.

Global forward hooks (`register_module_forward_hook` and its pre-hook) of the user's run
around every module call in the process: a call counter, an activation logger. Traced, they
ran for the module's own call alone on ORT steps, none of its submodules', with no sign of it.
So while one is registered a module with submodules is not captured whole: it runs in parts,
down to modules without submodules, around whose lazy calls the hooks run as in eager. A trace
never calls them (it would call them for lazygrad's own modules too: the wrapper around the
forward, the traced graphs); other threads' calls (an eager step beside a background build)
reach them as they are. Nor does a trace call global backward hooks (`backward_hooks.py`): a
module traced with them (one without submodules, around whose lazy call they run) would apply
them twice.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lazygrad import global_hooks
from lazygrad.capture.errors import CaptureError
from lazygrad.code_globals import is_library

_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
# What reads a tensor's metadata, not its values: a shape logger computes nothing.
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "nelement", "ndimension",
                       "element_size", "is_contiguous", "__len__", "__format__", "__repr__",
                       "__str__", "type", "get_device", "storage_offset"})


@contextlib.contextmanager
def watching(module: torch.nn.Module) -> Iterator[list[str]]:
    """Around a trace of `module`: yields the names of the submodules whose hooks of the user's
    ran for side effects only (`refuse_side_effects`); the global hooks of the user's are hidden
    from this thread. The hooks are put back on exit."""
    found: list[str] = []
    swapped: list[tuple[dict, Any, Callable[..., Any]]] = []
    for name, submodule in module.named_modules():
        if not name:  # the module's own hooks wrap its lazy call
            continue
        for attribute in _HOOKS:
            hooks = getattr(submodule, attribute, None) or {}
            for key, hook in list(hooks.items()):
                if _users(hook):
                    hooks[key] = _watched(hook, name, found)
                    swapped.append((hooks, key, hook))
    for hooks in global_hooks.ALL:
        for key, hook in list(hooks.items()):
            if _users(hook):
                hooks[key] = _hidden_from_this_thread(hook)
                swapped.append((hooks, key, hook))
    try:
        yield found
    finally:
        for hooks, key, hook in swapped:
            if key in hooks:
                hooks[key] = hook


def refuse_global_hooks(module: torch.nn.Module) -> None:
    """Raise CaptureError if global forward hooks of the user's would be called for submodules
    of `module`."""
    if next(module.children(), None) is not None and any(
            _users(hook) for hooks in global_hooks.FORWARD for hook in hooks.values()):
        raise CaptureError("global module forward hooks are registered: torch calls them around "
                           "every submodule's forward, which ORT steps would skip")


def refuse_side_effects(found: list[str]) -> None:
    if found:
        names = sorted(set(found))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise CaptureError(
            f"forward hooks on submodules ({shown}) return nothing and compute nothing: they run "
            "for what they do in Python (a counter, a logger), which ORT steps would skip")


def _users(hook: Callable[..., Any]) -> bool:
    """Whether the hook's code is the user's, not an installed library's."""
    target: Any = hook.func if isinstance(hook, functools.partial) else hook
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None) or getattr(type(target).__call__, "__code__", None)
    return code is not None and not is_library(code.co_filename)


def _watched(hook: Callable[..., Any], name: str, found: list[str]) -> Callable[..., Any]:
    def watched(*args: Any, **kwargs: Any) -> Any:
        with _Computing() as computing:
            result = hook(*args, **kwargs)
        if result is None and not computing.ops:
            found.append(name)
        return result

    return watched


def _hidden_from_this_thread(hook: Callable[..., Any]) -> Callable[..., Any]:
    thread = threading.get_ident()

    def hidden(*args: Any, **kwargs: Any) -> Any:
        return None if threading.get_ident() == thread else hook(*args, **kwargs)

    return hidden


class _Computing(TorchFunctionMode):
    """Counts the tensor ops run inside it, metadata reads aside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") not in _METADATA:
            self.ops += 1
        return func(*args, **(kwargs or {}))
