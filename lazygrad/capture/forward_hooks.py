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

A trace calls the hooks with its own tensors, so whatever such a hook does reaches the user's
objects once per trace: a counter counts the trace's calls, and a list that collects outputs
holds the trace's tensors, which fail the user's code that stacks them later ("Attempting to
use FunctionalTensor on its own"). A signature's first call, which eager PyTorch runs anyway,
watches the same hooks with real tensors first (`watching_eager_call`): a hook found there to
run for side effects, or to keep a tensor (`escapes.refuse_kept_by_hooks`), sends the module to
its parts before any trace calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

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
    thread = threading.get_ident()
    global_ones = [(hooks, None) for hooks in global_hooks.ALL]
    with _hooks_wrapped(_hook_dicts(module), _watch(found, None, None)), \
            _hooks_wrapped(global_ones, lambda name: _hidden_from(thread)):
        yield found


@dataclasses.dataclass
class EagerHooks:
    """What the hooks on submodules did in an eager call (`watching_eager_call`)."""

    side_effects: list[str] = dataclasses.field(default_factory=list)  # the user's, as `watching`
    touched: list[weakref.ref] = dataclasses.field(default_factory=list)  # tensors seen or made


@contextlib.contextmanager
def watching_eager_call(module: torch.nn.Module) -> Iterator[EagerHooks]:
    """Around an eager call of `module` on this thread: the user's hooks on its submodules run
    as they would, watched as a trace watches them (`watching`), and the tensors they and
    libraries' hooks are given, return or make are referenced weakly, for
    `escapes.refuse_kept_by_hooks`. Libraries' hooks are traced with the rest where what they
    keep stays inside the call; but a submodule captured on its own (a part of a module that
    runs in parts) may hold a hook that files its outputs in a collector of the call around
    it (Hugging Face's output recorders: the router logits a Mixtral's loss reads), which ORT
    steps would leave empty (the trace, on the builder's thread, sees no collector). Global
    hooks are left alone (an eager call runs them). The hooks are put back on exit."""
    seen = EagerHooks()
    dicts, thread = _hook_dicts(module), threading.get_ident()
    with _hooks_wrapped(dicts, _watch(seen.side_effects, seen.touched, thread)), \
            _hooks_wrapped(dicts, _watch(None, seen.touched, thread), libraries=True):
        yield seen


class _Wrapped:
    """A hook of the user's as a watch replaced it in its dict: `around(hook, ...)` runs it
    while the watch is on. A watch may start or end while another one runs (a signature's first
    call, watched on the caller's thread, beside the background trace of another): each wraps
    what the dict holds, and each puts back what is under its wrapper once it ends, past any
    other watch's that has ended too (`_hooks_wrapped`), so a watch that ends first takes
    no wrapper of a running one away, and none is left behind."""

    def __init__(self, hook: Callable[..., Any], around: Callable[..., Any]) -> None:
        self.__wrapped__ = hook
        self.around = around
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.__wrapped__(*args, **kwargs)
        return self.around(self.__wrapped__, *args, **kwargs)


@contextlib.contextmanager
def _hooks_wrapped(
    dicts: list[tuple[dict, str | None]], around_for: Callable[[str | None], Callable[..., Any]],
    libraries: bool = False,
) -> Iterator[None]:
    """Each hook of the user's in `dicts` (hook dicts, each with its submodule's name) replaced
    by a `_Wrapped` with `around_for(name)` for the time of the block; with `libraries`, each
    hook of an installed library's instead."""
    swapped: list[tuple[dict, Any, _Wrapped]] = []
    for hooks, name in dicts:
        for key, hook in list(hooks.items()):
            if _users(hook) != libraries:
                hooks[key] = wrapper = _Wrapped(hook, around_for(name))
                swapped.append((hooks, key, wrapper))
    try:
        yield
    finally:
        for _, _, wrapper in swapped:
            wrapper.active = False
        for hooks, key, _ in swapped:
            held = hooks.get(key)
            while isinstance(held, _Wrapped) and not held.active:
                held = held.__wrapped__
            if key in hooks:
                hooks[key] = held


def _hook_dicts(module: torch.nn.Module) -> list[tuple[dict, str | None]]:
    """The forward hook and pre-hook dicts of `module`'s submodules (its own hooks wrap its
    lazy call), each with the submodule's name."""
    return [(hooks, name) for name, submodule in module.named_modules() if name
            for attribute in _HOOKS if (hooks := getattr(submodule, attribute, None))]


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
    while isinstance(hook, _Wrapped):
        hook = hook.__wrapped__
    target: Any = hook.func if isinstance(hook, functools.partial) else hook
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None) or getattr(type(target).__call__, "__code__", None)
    return code is not None and not is_library(code.co_filename)


def _watch(found: list[str] | None, touched: list[weakref.ref] | None,
           thread: int | None) -> Callable[[str | None], Callable[..., Any]]:
    """For `_hooks_wrapped`: a hook of submodule `name` run so that `name` is noted in
    `found` (unless None) when it returns nothing and runs no tensor op; with `touched`, the
    tensors it is given, returns or makes are noted too (weakly); with `thread`, only its calls
    on that thread are watched."""
    def around_for(name: str | None) -> Callable[..., Any]:
        def around(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if thread is not None and threading.get_ident() != thread:
                return hook(*args, **kwargs)
            with _Computing(touched) as computing:
                result = hook(*args, **kwargs)
            if touched is not None:
                touched.extend(_weak_tensors((args, kwargs, result)))
            if found is not None and result is None and not computing.ops:
                found.append(name)
            return result

        return around

    return around_for


def _weak_tensors(tree: Any) -> list[weakref.ref]:
    return [weakref.ref(leaf) for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _hidden_from(thread: int) -> Callable[..., Any]:
    def hidden(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return None if threading.get_ident() == thread else hook(*args, **kwargs)

    return hidden


class _Computing(TorchFunctionMode):
    """Counts the tensor ops run inside it, metadata reads aside; with `made`, notes (weakly)
    the tensors they return."""

    def __init__(self, made: list[weakref.ref] | None = None) -> None:
        super().__init__()
        self.ops = 0
        self.made = made

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") not in _METADATA:
            self.ops += 1
        result = func(*args, **(kwargs or {}))
        if self.made is not None:
            self.made.extend(_weak_tensors(result))
        return result
