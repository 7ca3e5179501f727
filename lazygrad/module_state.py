"""The module's parameters, buffers, train/eval flags and plain attributes, read on every call.

A trace reads Python attributes of the modules (a flag, a size, a scale) as constants: they are
part of what a graph was captured for, so every plain attribute (a bool, number, string, None,
or a tuple of them) of every submodule is part of the call's signature, and changing one
captures again.

`named_parameters()` walks the module tree with generators and builds every name string; on a
small model that walk costs more than ONNX Runtime's own run. The tree rarely changes, so it is
walked again only when it may have: torch's global registration hooks report every parameter,
buffer and submodule assigned anywhere, and each call also checks that every cached tensor is
still the one its module holds (which catches direct writes to `_parameters`, as
`torch.__future__.set_overwrite_module_params_on_conversion` makes `.to()` do).
"""

from __future__ import annotations

import itertools

import torch
from torch.nn.modules import module as torch_module

_changes = itertools.count()
_structure_version = next(_changes)


def _structure_changed(*_: object) -> None:
    global _structure_version
    _structure_version = next(_changes)


torch_module.register_module_parameter_registration_hook(_structure_changed)
torch_module.register_module_buffer_registration_hook(_structure_changed)
torch_module.register_module_module_registration_hook(_structure_changed)


class ModuleState:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._version = -1
        self._modules: list[torch.nn.Module] = []
        self._owners: list[tuple[dict, str, torch.Tensor]] = []
        self._state: dict[str, torch.Tensor] = {}

    def read(self) -> tuple[dict[str, torch.Tensor], tuple]:
        """Parameters and buffers by qualified name, and the plain attributes of every
        submodule (its training flag among them)."""
        if self._version != _structure_version or not self._current():
            self._walk()
        return self._state, tuple(
            tuple(item for item in m.__dict__.items() if _is_plain(item[1]))
            for m in self._modules
        )

    def _current(self) -> bool:
        return all(owner.get(name) is tensor for owner, name, tensor in self._owners)

    def _walk(self) -> None:
        self._version = _structure_version
        self._modules = list(self.module.modules())
        state: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        state.update(self.module.named_buffers())
        owners = []
        for qualified, tensor in state.items():
            prefix, _, name = qualified.rpartition(".")
            owner = self.module.get_submodule(prefix)
            table = owner._parameters if name in owner._parameters else owner._buffers
            owners.append((table, name, tensor))
        self._owners = owners
        self._state = state


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _is_plain(value: object) -> bool:
    if type(value) in _PLAIN:
        return True
    return type(value) is tuple and all(type(v) in _PLAIN for v in value)
