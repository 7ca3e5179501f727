"""Hooks torch calls around every module's forward or backward, registered by anyone.

`torch.nn.modules.module.register_module_forward_hook` and its kin (pre-hooks, backward hooks)
hang a hook on every module call in the process: a call counter, an activation logger, a
profiler's module tracker. A trace runs them once, on fake tensors; ORT steps run no Python.
So the hooks registered are part of every call's signature (one registered after a build is
met by a new capture, not skipped by the old graphs), and no disk index record serves a process
that has one (the capture decides how they run: `capture/forward_hooks.py`,
`capture/backward_hooks.py`). lazygrad's own global hooks, which a trace registers for as long
as it runs, are marked with `own` and left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.modules import module as torch_module

FORWARD = (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks)
BACKWARD = (torch_module._global_backward_pre_hooks, torch_module._global_backward_hooks)
ALL = FORWARD + BACKWARD
_OWN = "_lazygrad_own_hook"


def own(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a global hook as lazygrad's: not the user's, not part of the signature."""
    setattr(hook, _OWN, True)
    return hook


def registered() -> tuple[tuple[int, ...], ...]:
    """The handle ids of the global hooks not lazygrad's, per hook dict (`ALL`'s order)."""
    return tuple(tuple(key for key, hook in hooks.items() if not getattr(hook, _OWN, False))
                 for hooks in ALL)
