"""Where a module's runtime lives, and how its calls reach it.

An instance made lazy (`lazygrad.lazy(model)`), and a submodule that became a lazy part of a
module captured in parts, hold their runtime in the instance's `__dict__` together with an
instance `forward` that calls it: `nn.Module.__call__` (and the user's hooks around it) is
untouched, and the class is not changed. An instance of a class decorated with
`@lazygrad.lazy` gets its runtime on first use.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lazygrad import user_code
from lazygrad.capture.private import checkpoint_region, traced_by_torch

RUNTIME = "_lazygrad_runtime"
OPTIONS = "_lazygrad_options"
ORIGINAL_FORWARD = "_lazygrad_original_forward"
INSTANCE_FORWARD = "_lazygrad_instance_forward"


class LazyForward:
    """An instance's forward made lazy; a plain object so the module still pickles."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_lazily(self.runtime, args, kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The parameters of the forward the calls run, not `(*args, **kwargs)`: callers read
        them (Hugging Face's Trainer drops every batch column the forward does not name, so the
        model got none; generation checks `cache_position`)."""
        return inspect.signature(forward_run_by(self.runtime.module))

    @property
    def __code__(self) -> Any:
        """The code of the forward the calls run: torch.export (and the ONNX exporter on it)
        reads `module.forward.__code__` before it traces the call as a plain module's."""
        return forward_run_by(self.runtime.module).__code__


def call_lazily(runtime: Any, args: tuple, kwargs: dict) -> Any:
    """A lazy module's call: as a plain module where torch compiles, exports or transforms it,
    and under autograd's anomaly mode (which checks each of eager's backward nodes for NaN;
    ORT's backward is one node, and a NaN made and masked inside it went unseen); inside a
    non-reentrant checkpoint region, the way the region's recomputation can repeat
    (`Runtime.in_region`); else through its runtime."""
    if traced_by_torch() or torch.is_anomaly_enabled():
        return run_forward(runtime.module, *args, **kwargs)
    region = checkpoint_region()
    if region is not None:
        return runtime.in_region(region, args, kwargs)
    return runtime(args, kwargs)


def install(module: torch.nn.Module, runtime: Any) -> None:
    """Route the instance's calls through `runtime`. A `forward` the user put on the instance
    (a patched forward, accelerate's hooks) is kept: it is what the calls run (`run_forward`)."""
    own = module.__dict__.get("forward")
    if own is not None and not isinstance(own, LazyForward):
        module.__dict__[INSTANCE_FORWARD] = own
    module.__dict__[RUNTIME] = runtime
    module.__dict__["forward"] = LazyForward(runtime)


def forward_run_by(module: torch.nn.Module) -> Any:
    """The forward the module's calls run, bound: the forward the user had put on the instance
    when it was made lazy, read from the module called (a copy of the module runs its copy: a
    bound method is bound to the copy), else the class's original forward. Lazygrad's own
    forward replaced a patched one silently before (a submodule made a part ran its class's
    forward). A forward put on the instance later wraps lazygrad's (accelerate's autocast
    does): it is never what the runtime runs, which recursed without end."""
    own = module.__dict__.get(INSTANCE_FORWARD)
    if own is None:
        return original_forward(type(module)).__get__(module)
    return own


def run_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run the forward the module's calls run (`forward_run_by`), never beside another
    thread's trace (`user_code.py`)."""
    with user_code.eager_run():
        return forward_run_by(module)(*args, **kwargs)


def installed(module: torch.nn.Module) -> Any | None:
    """The runtime this instance holds, if it holds one."""
    return module.__dict__.get(RUNTIME)


def class_options(module: torch.nn.Module) -> Any | None:
    """The options of `@lazygrad.lazy` on the module's class (None: the class is not lazy)."""
    return getattr(type(module), OPTIONS, None)


def original_forward(cls: type) -> Any:
    """The forward a lazy class (or a class with a lazy instance) had before it was made lazy."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass.__dict__.get(ORIGINAL_FORWARD, klass.__dict__["forward"])
    raise TypeError(f"lazygrad: {cls.__name__} defines no forward")
