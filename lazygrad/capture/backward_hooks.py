"""Backward hooks on submodules: user code that autograd calls with each step's gradients.

`register_full_backward_hook` and `register_full_backward_pre_hook` (and the older
`register_backward_hook`) hang the hook on the autograd nodes around a submodule's call. A trace
keeps the ops and drops those nodes: ORT steps would neither call the hook (a gradient logger
sees nothing) nor apply what it returns (a gradient rescaled by the hook would not be; measured
3.8 absolute in a weight's gradient), with no sign of it. So a module whose submodules hold
backward hooks, or while global ones are registered, is not captured whole: it runs in parts,
and each hooked submodule, called by eager PyTorch, gets its hooks around its own lazy call,
where autograd calls them as in eager. A module's own hooks wrap its lazy call already.
"""

from __future__ import annotations

import torch
import torch.nn.modules.module as torch_module

from lazygrad.capture.errors import CaptureError

_HOOKS = ("_backward_hooks", "_backward_pre_hooks")


def refuse_backward_hooks(module: torch.nn.Module) -> None:
    """Raise CaptureError, naming the submodules, if backward hooks would be called inside."""
    hooked = [name for name, submodule in module.named_modules() if name and any(
        getattr(submodule, hooks, None) for hooks in _HOOKS)]
    if hooked:
        shown = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more" if len(hooked) > 4 else "")
        raise CaptureError(f"backward hooks on submodules ({shown}) are called by autograd with "
                           "each step's gradients, which a traced graph would not do")
    hooked_globally = torch_module._global_backward_hooks or \
        torch_module._global_backward_pre_hooks
    if hooked_globally and next(module.children(), None) is not None:
        raise CaptureError("global module backward hooks are registered: autograd calls them "
                           "for every submodule, which a traced graph would not do")
