"""A forward's result as flat tensors, and back: what the graphs return and the user receives.

Containers (tuples, lists, dicts, dataclasses, anything registered with torch.utils._pytree,
Hugging Face's ModelOutput) are flattened by pytree. A plain Python object among the leaves (a
Hugging Face `DynamicCache`, say) is walked through its attributes, lists, tuples and dicts: its
tensors become graph outputs too, and each call gets a fresh copy of the object holding that
call's tensors. Everything else in the result must be a plain value (it is returned as traced).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from lazygrad.signature import VALUES, flatten

_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

_JSON = (type(None), bool, int, float, str)  # kept exactly by a JSON round trip


def tensors_of(result: Any) -> list[torch.Tensor]:
    """Every tensor of `result`, in the order the graphs return them."""
    return [t for leaf in flatten(result)[0] for t in _held(leaf, set())]


def sized_numbers(result: Any) -> tuple[int, list[tuple[int, Any]]]:
    """How many numbers a traced `result` holds, and those that are sizes (`x.shape[0]`, a
    cache's length), as (position among its numbers, symbolic value): each call gets them from
    its own sizes (`OutputTemplate.rebuild`), never the first call's."""
    numbers = _Numbers({})
    for leaf in flatten(result)[0]:
        _rebuilt(leaf, iter(lambda: None, 0), numbers)
    return numbers.count, numbers.symbolic


class _Slot:
    """Where a tensor goes in a template (the template holds none of the first call's)."""


_SLOT = _Slot()


@dataclasses.dataclass
class OutputTemplate:
    """How to rebuild the module's return value from its flat tensor outputs."""

    structure: pytree.TreeSpec
    leaves: list[Any]  # the first result's leaves, every tensor replaced by a slot

    def __post_init__(self) -> None:
        # `return a, b, c` of tensors, the common case, is rebuilt without pytree.
        self.plain_tuple = (
            self.structure.type is tuple
            and all(leaf is _SLOT for leaf in self.leaves)
            and all(child.is_leaf() for child in self.structure.children())
        )

    @classmethod
    def of(cls, result: Any) -> tuple[OutputTemplate, list[torch.Tensor]]:
        """The template of a forward's result, and its tensors; ValueError where a leaf can
        hide tensors that cannot be found (a module, an object with __slots__, a cycle)."""
        leaves, structure = flatten(result)
        held = [_held(leaf, set()) for leaf in leaves]
        slots = [_rebuilt(leaf, iter([_SLOT] * len(h)), _Numbers({}))
                 for leaf, h in zip(leaves, held)]
        return cls(structure, slots), [t for h in held for t in h]

    def to_json(self) -> dict | None:
        """The template as plain data, for the disk index; None where it has no plain form
        (a namedtuple or container type without a serialized name, an object among the
        results, a value JSON does not keep as it is)."""
        leaves: list[list[Any]] = []
        for leaf in self.leaves:
            if leaf is _SLOT:
                leaves.append(["tensor"])
            elif type(leaf) in _JSON:
                leaves.append(["value", leaf])
            else:
                return None
        try:
            structure = pytree.treespec_dumps(self.structure)
        except (NotImplementedError, TypeError, ValueError):
            return None
        return {"structure": structure, "leaves": leaves}

    @classmethod
    def from_json(cls, data: dict) -> OutputTemplate:
        """The template `to_json` gave (raises where this process cannot rebuild it)."""
        leaves = [_SLOT if leaf[0] == "tensor" else leaf[1] for leaf in data["leaves"]]
        return cls(pytree.treespec_loads(data["structure"]), leaves)

    @property
    def number_count(self) -> int:
        """How many numbers the result holds (positions `rebuild` replaces are among them)."""
        numbers = _Numbers({})
        for leaf in self.leaves:
            _rebuilt(leaf, iter(lambda: None, 0), numbers)
        return numbers.count

    def rebuild(self, tensors: list[torch.Tensor], sizes: dict[int, Any] | None = None) -> Any:
        """The result holding `tensors`; `sizes`: the numbers at these positions among its
        numbers replaced (`sized_numbers`)."""
        if self.plain_tuple:
            return tuple(tensors)
        supply, numbers = iter(tensors), _Numbers(sizes or {})
        return pytree.tree_unflatten([_rebuilt(leaf, supply, numbers) for leaf in self.leaves],
                                     self.structure)


def _held(value: Any, seen: set[int]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (*VALUES, *_SYMBOLIC)):
        return []
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _held(item, seen)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _held(item, seen)]
    if isinstance(value, torch.nn.Module) or not hasattr(value, "__dict__") or id(value) in seen:
        raise ValueError(
            f"the forward returns a {type(value).__name__}, which is neither a tensor, a plain "
            "value, a container nor a plain object whose attributes hold them"
        )
    seen.add(id(value))
    return [t for item in vars(value).values() for t in _held(item, seen)]


class _Numbers:
    """The numbers met while walking a result, counted; `replace`: by position."""

    def __init__(self, replace: dict[int, Any]) -> None:
        self.replace, self.count, self.symbolic = replace, 0, []

    def met(self, value: Any) -> Any:
        position, self.count = self.count, self.count + 1
        if isinstance(value, _SYMBOLIC):
            self.symbolic.append((position, value))
        return self.replace.get(position, value)


def _rebuilt(value: Any, tensors: Iterator[Any], numbers: _Numbers) -> Any:
    """`value` with its tensors (or slots) replaced by the next ones of `tensors` (containers
    and objects copied, plain values shared, numbers as `numbers` says)."""
    if isinstance(value, (torch.Tensor, _Slot)):
        return next(tensors)
    if isinstance(value, _NUMBERS):
        return numbers.met(value)
    if isinstance(value, VALUES):  # returned as they were: they cannot hide a tensor
        return value
    if isinstance(value, list):
        return [_rebuilt(item, tensors, numbers) for item in value]
    if isinstance(value, tuple):
        items = [_rebuilt(item, tensors, numbers) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _rebuilt(item, tensors, numbers)
        return copied
    copied = copy.copy(value)
    for key, item in vars(value).items():
        copied.__dict__[key] = _rebuilt(item, tensors, numbers)
    return copied
