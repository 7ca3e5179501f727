"""Graph breaks at module granularity: which submodules of a module become lazy parts.

A module whose call cannot be captured whole (a router that dispatches with `nonzero()`, an op
without an ONNX translation) runs its own forward in eager PyTorch, and its largest submodules
become lazy modules of their own: each captures, caches per signature and grad mask, and falls
back (or breaks further) on its own. A submodule without parameters has no gradient to
specialise and little to gain from a graph of its own: it runs in eager PyTorch with its parent,
as a TorchScript module does (its parameters cannot be swapped for a trace's). Containers that
are never called themselves (`ModuleList`, `ModuleDict`) are looked through.
"""

from __future__ import annotations

import torch


def parts_of(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, submodule) of each part, in registration order, each module once."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen = {id(module)}

    def visit(prefix: str, parent: torch.nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if next(child.parameters(), None) is None or isinstance(child, torch.jit.ScriptModule):
                continue
            qualified = f"{prefix}{name}"
            if type(child).forward is torch.nn.Module.forward:
                visit(f"{qualified}.", child)
            else:
                found.append((qualified, child))

    visit("", module)
    return found
