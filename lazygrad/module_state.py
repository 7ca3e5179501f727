"""The module's parameters, buffers, train/eval flags and plain attributes, read on every call.

A trace reads Python attributes of the modules (a flag, a size, a scale) as constants: they are
part of what a graph was captured for, so every plain attribute (a bool, number, string, None,
or a tuple of them) of every submodule is part of the call's signature, and changing one
captures again; every one whose name the model's code names (its classes' code, installed or
not, and the user's functions it calls: `code_globals.GlobalsRead.attribute_names`), as what a
training loop keeps on the model and the forward never reads changes at every step. So are, per
submodule, the ids of its forward and backward hooks (a hook added or removed after a build is
traced into the next graph, not ignored), an instance `forward` put in its place, and the plain
attributes of the plain objects it holds (a Hugging Face `config`, which its forward reads at
every call: a logit soft-cap or a sliding window changed on the config served the old graph,
silently wrong, before). So are its tensor attributes that are neither parameters nor buffers (a
mask or a scale kept as a plain attribute), by identity and version counter: a trace bakes their
values into the graph, and one replaced or changed in place after a build served the old values,
silently wrong, before. So are its list and dict attributes that hold only such values (plain
values, tensors, and lists, tuples and dicts of them: indices kept as `self.keep = [0, 2]`,
anchors kept in a list, a dict of scales), by their items: one replaced, or a tensor among them
changed in place, after a build served the old values, silently wrong, before. So are the
functions it holds (`self.act = torch.tanh`, by identity), NumPy scalars and arrays (an array of
up to `ARRAY_BYTES` by its bytes, compared at every call: it has no version counter) and sets of
plain values: each changed after a build served the old graph, silently wrong, before. And so
are the plain module-level values the user's code reads (`code_globals.py`), compared by
identity at every call, and the global module hooks registered (`global_hooks.py`).

`named_parameters()` walks the module tree with generators and builds every name string; on a
small model that walk costs more than ONNX Runtime's own run. The tree rarely changes, so it is
walked again only when it may have: torch's global registration hooks report every parameter,
buffer and submodule assigned anywhere, and each call also checks that every cached tensor is
still the one its module holds (which catches direct writes to `_parameters`, as
`torch.__future__.set_overwrite_module_params_on_conversion` makes `.to()` do).

The plain attributes are read again only when a submodule's `__dict__` (or one of its hook
dicts, the `__dict__` of an object it holds, or one of its list and dict attributes) changed:
each call compares every such dict's (and list's) keys and values, by identity, with those the
attributes were last read from (a few C-level passes, where filtering every attribute in Python
cost more than ORT's run), and returns the very same `modes` tuple while they match. The values
compared are held until the next change, so an attribute the module replaced stays alive until
its next call.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.modules import module as torch_module
from torch.nn.parameter import is_lazy

from lazygrad import global_hooks
from lazygrad.attach import LazyForward
from lazygrad.code_globals import (
    GlobalsRead,
    functions_held,
    is_array,
    is_code,
    is_plain,
    version_of,
)

_changes = itertools.count()
_structure_version = next(_changes)


def _structure_changed(*_: object) -> None:
    global _structure_version
    _structure_version = next(_changes)


torch_module.register_module_parameter_registration_hook(_structure_changed)
torch_module.register_module_buffer_registration_hook(_structure_changed)
torch_module.register_module_module_registration_hook(_structure_changed)


class _Attributes(NamedTuple):
    """The plain attributes of every submodule (`modes`), and what they were read from: every
    submodule's `__dict__`, then the dicts it holds that are watched too (`extras`: its hook
    dicts that hold hooks, the `__dict__`s of its plain objects), as lengths, keys and values
    (held, so no identity is reused); and every hook dict's length (`hooks`, `hook_lengths`:
    a hook added to an empty one, in one pass)."""

    lengths: list[int]
    keys: list[object]
    values: list[object]
    modes: tuple
    extras: list[dict]
    hooks: list[dict]
    hook_lengths: list[int]
    lists: list[list]  # the list attributes read (and the lists inside them and inside dicts)
    list_lengths: list[int]
    list_items: list[object]  # their items, held
    tensors: list[torch.Tensor]  # the submodules' plain tensor attributes (and those held in
    # their lists and dicts), the globals read
    versions: list[int]  # their version counters when read
    arrays: list[Any]  # the NumPy arrays among the attributes (no version counter)
    array_contents: list[bytes]  # their bytes when read
    sets: list[set]  # the sets of plain values read
    set_contents: list[frozenset]  # their contents when read
    global_values: list[object]  # the module-level values the code reads (`code_globals.py`)


class ModuleState:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._version = -1
        self._modules: list[torch.nn.Module] = []
        self._tables: list[dict] = []  # per state tensor: the `_parameters`/`_buffers` holding it
        # how a table is read: `dict.get` in one C call, or a TorchScript module's own mapping
        self._get: Callable[[Any, str], Any] = dict.get
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._state_ids: frozenset[int] = frozenset()
        # parameters or buffers not materialised yet (`nn.LazyLinear`): they have no shape
        self._lazy: list[torch.Tensor] = []
        self._state: dict[str, torch.Tensor] = {}
        self._attributes: _Attributes | None = None
        self._globals: GlobalsRead | None = None
        self._held: list[int] = []  # ids of the functions the modules held when it was made
        # id(submodule) -> the tensor attributes each call writes (`exclude`)
        self._written: dict[int, frozenset[str]] = {}

    def read(self) -> tuple[dict[str, torch.Tensor], tuple]:
        """Parameters and buffers by qualified name, and the plain attributes of every
        submodule (its training flag among them). Both are the same objects as the last call's
        while nothing they were read from changed."""
        if self._version != _structure_version or not self._current():
            self._walk()
        dicts = list(map(vars, self._modules))
        if self._written:
            dicts = [_without(d, self._written.get(id(m))) for d, m in zip(dicts, self._modules)]
        attributes = self._attributes
        global_values = self._globals.values()
        globals_same = attributes is not None and all(
            map(operator.is_, global_values, attributes.global_values))
        if (not globals_same or list(map(len, attributes.hooks)) != attributes.hook_lengths
                or list(map(version_of, attributes.tensors)) != attributes.versions
                or list(map(_contents, attributes.arrays)) != attributes.array_contents
                or list(map(frozenset, attributes.sets)) != attributes.set_contents
                or not _unchanged(attributes, dicts + attributes.extras)
                or list(map(len, attributes.lists)) != attributes.list_lengths
                or not all(map(operator.is_, _chain(attributes.lists), attributes.list_items))):
            held = self._functions_held()
            if held != self._held or (attributes is not None and not globals_same):
                # a hook or function added since, or a global replaced (by another function):
                # the values they read
                self._globals, self._held = GlobalsRead(self.module), held
                global_values = self._globals.values()
            attributes = self._attributes = _read(dicts, attributes, self._globals,
                                                  global_values, self._state_ids)
        return self._state, attributes.modes

    def _functions_held(self) -> list[int]:
        return [id(f) for m in self._modules for f in functions_held(m)]

    def written_between(self, before: tuple, after: tuple) -> dict[int, frozenset[str]] | None:
        """What a call that turned the modes `before` into `after` changed, if it changed
        tensor attributes alone (a weight norm's `weight`, set by its pre-hook at every call; a
        tensor kept for a look later): id(submodule) -> their names. None if it changed
        anything else (a plain value, a hook, a global)."""
        count = len(self._modules)
        if len(before) != len(after) or before[count:] != after[count:]:
            return None
        written = {}
        for module, old, new in zip(self._modules, before, after):
            if old == new:
                continue
            tensors = {name for name, value in new if _is_tensor_mode(value)}
            names = {name for name, _ in set(old) ^ set(new)}
            if not names <= tensors:
                return None
            written[id(module)] = frozenset(names)
        return written or None

    def exclude(self, written: dict[int, frozenset[str]]) -> None:
        """Leave these tensor attributes (id(submodule) -> names) out of the modes: each call
        writes them before reading them, so they are results of the call, not part of what
        it is captured for (`Runtime._adopt_writes`)."""
        self._written = written
        self._attributes = None

    @property
    def uninitialized(self) -> bool:
        """Whether a parameter or buffer has no shape yet (a lazy module before its first
        call, which materialises it in place)."""
        if self._lazy:
            self._lazy = [t for t in self._lazy if is_lazy(t)]
        return bool(self._lazy)

    def _current(self) -> bool:
        return all(map(operator.is_, map(self._get, self._tables, self._names), self._tensors))

    def _walk(self) -> None:
        self._version = _structure_version
        self._modules = list(self.module.modules())
        self._globals, self._held = GlobalsRead(self.module), self._functions_held()
        self._attributes = None  # the watched globals may be others
        state: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        state.update(self.module.named_buffers())
        self._tables, self._names, self._tensors = [], [], []
        for qualified, tensor in state.items():
            prefix, _, name = qualified.rpartition(".")
            owner = self.module.get_submodule(prefix)
            self._tables.append(owner._parameters if name in owner._parameters else owner._buffers)
            self._names.append(name)
            self._tensors.append(tensor)
        self._get = dict.get if all(type(table) is dict for table in self._tables) else _get
        self._lazy = [t for t in self._tensors if is_lazy(t)]
        self._state_ids = frozenset(map(id, self._tensors))
        self._state = state


def _without(attributes: dict, names: frozenset[str] | None) -> dict:
    if not names:
        return attributes
    return {key: value for key, value in attributes.items() if key not in names}


def _is_tensor_mode(value: object) -> bool:
    """Whether a mode's value is a tensor attribute's (`_modes_of`)."""
    return type(value) is tuple and len(value) == 3 and value[0] == "tensor"


def _get(table: Any, name: str) -> Any:
    """A TorchScript module's `_parameters` (an `OrderedDictWrapper`, no `dict.get`)."""
    return table[name] if name in table else None  # noqa: SIM401


def _unchanged(attributes: _Attributes, dicts: list[dict]) -> bool:
    """Whether these `__dict__`s hold the same keys and the very same values as when
    `attributes` were read. A plain value is immutable, so any change that concerns one (a
    non-plain value replaced by a plain one included) replaces an object: identity is exact,
    and it compares no values (`==` on a tensor attribute would compare elements)."""
    return (
        list(map(len, dicts)) == attributes.lengths
        and all(map(operator.is_, _chain(map(dict.values, dicts)), attributes.values))
        and list(_chain(map(dict.keys, dicts))) == attributes.keys
    )


def plain_attributes(module: torch.nn.Module) -> tuple:
    """The module's own plain attributes (its flags, sizes and modes), as (name, value) pairs."""
    return tuple(item for item in module.__dict__.items() if is_plain(item[1]))


def _read(dicts: list[dict], previous: _Attributes | None, globals_read: GlobalsRead,
          global_values: list[object], state_ids: frozenset[int]) -> _Attributes:
    containers = _Containers(state_ids)
    # An attribute whose name no code of the model names is not read by its forward (a step
    # counter the loop keeps on the model); a global hook's code is not walked: all are kept.
    named = None if any(global_hooks.registered()) else globals_read.attribute_names
    modes = (*(_modes_of(d, containers, named) for d in dicts),
             globals_read.modes(global_values, lambda value: _global_mode(value, containers)),
             global_hooks.registered())
    if previous is not None and modes == previous.modes:
        modes = previous.modes  # the same object while equal: the signature's fast path
    hooks = [hook for d in dicts for name in _HOOKS
             if isinstance(hook := d.get(name), dict)] + list(global_hooks.ALL)
    extras = [hook for hook in hooks if hook] + list(containers.objects.values())
    extras += containers.dicts
    watched = dicts + extras
    tensors = [v for d in dicts for v in d.values() if isinstance(v, torch.Tensor)]
    tensors += containers.tensors
    tensors += [v for v in global_values if isinstance(v, torch.Tensor)]
    return _Attributes(
        list(map(len, watched)),
        list(_chain(map(dict.keys, watched))),
        list(_chain(map(dict.values, watched))),
        modes,
        extras,
        hooks,
        list(map(len, hooks)),
        containers.lists,
        list(map(len, containers.lists)),
        list(_chain(containers.lists)),
        tensors,
        list(map(version_of, tensors)),
        containers.arrays,
        list(map(_contents, containers.arrays)),
        containers.sets,
        list(map(frozenset, containers.sets)),
        global_values,
    )


def global_modes(module: torch.nn.Module) -> tuple:
    """The part of the module's modes that the values its code reads make now (`_read`'s), for
    a module tree that holds the same tensors (a build's copy of it)."""
    state_ids = frozenset(map(id, itertools.chain(module.parameters(), module.buffers())))
    containers = _Containers(state_ids)
    read = GlobalsRead(module)
    return read.modes(read.values(), lambda value: _global_mode(value, containers))


def globals_part(modes: tuple) -> tuple:
    """The part of `modes` (`ModuleState.read`'s) that `global_modes` makes."""
    return modes[-2]


# The hook dicts whose hooks run in a forward or its backward (the `_with_kwargs` and
# `_always_called` flags change with `_forward_hooks`).
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _global_mode(value: object, containers: _Containers) -> object:
    """A global or closed-over container of plain values (frozen item by item, its changes
    watched at every call) or settings object (its plain attributes, as a module's plain
    object's), for the modes; None for a container that holds anything else, tensors
    included, or nothing yet: a store the code fills (a hook's `store[name] = output`, which
    `capture/escapes.py` refuses), not settings it reads."""
    if _is_plain_object(value):
        return ("object", _settings_of(value, containers))
    probe = _Containers(containers.state_ids)
    if probe.frozen(value) is _UNWATCHED or probe.tensors or not value:
        return None
    return containers.frozen(value)


def _settings_of(value: object, containers: _Containers) -> tuple:
    """A plain object's plain attributes and the functions it holds (and its lists, dicts and
    sets of plain values, as they are when the object's `__dict__` changes: their contents are
    not compared at every call). Not the tensors and objects it holds: a trainer's or a run's
    state object (its step counter a level down, a loss kept as a tensor) changes at every
    step, and every step was a new signature, built and never served."""
    containers.objects[id(value)] = vars(value)
    settings = _Containers(containers.state_ids)
    modes = []
    for key, item in vars(value).items():
        if is_code(item):
            modes.append((key, item))
        elif not isinstance(item, torch.Tensor) and (
                frozen := settings.frozen(item)) is not _UNWATCHED:
            modes.append((key, frozen))
    return tuple(modes)


def _modes_of(attributes: dict, containers: _Containers, named: frozenset[str] | None
              ) -> tuple:
    """A submodule's part of the signature: its plain attributes; the functions it holds (an
    activation kept as `torch.tanh`, by identity); the ids of its hooks, per hook dict; its
    plain tensor attributes (by identity and version: a trace bakes their values in as
    constants); its list and dict attributes of such values, item by item (`containers`
    records what they hold); an instance `forward` (by identity); each plain object's
    settings (`_settings_of`: a config's). Of the attributes, those `named` by the model's
    code alone (None: all): one the training loop keeps on the model and changes at every step
    (`model.global_step += 1`, a list of losses) made every step a new signature, run eagerly
    and built, never served (`code_globals.GlobalsRead.attribute_names`)."""
    hooks = [(name, tuple(hooks)) for name in _HOOKS if (hooks := attributes.get(name))]
    forward = attributes.get("forward")
    if named is not None:
        attributes = {name: value for name, value in attributes.items() if name in named}
    modes = [item for item in attributes.items() if is_plain(item[1])]
    modes.extend(hooks)
    modes.extend((name, ("tensor", id(value), version_of(value)))
                 for name, value in attributes.items() if isinstance(value, torch.Tensor))
    for name, value in attributes.items():
        if is_array(value):
            modes.append((name, containers.frozen(value)))
        elif type(value) in _CONTAINERS and name not in _MODULE_INTERNALS \
                and not is_plain(value):
            items = containers.frozen(value)
            if items is not _UNWATCHED:
                modes.append((name, items))
    modes.extend(item for item in attributes.items()
                 if is_code(item[1]) and item[0] != "forward")  # compared by identity
    if forward is not None and not isinstance(forward, LazyForward):  # lazygrad's own: a part's
        modes.append(("forward", id(forward)))
    for name, value in attributes.items():
        if _is_plain_object(value):
            modes.append((name, _settings_of(value, containers)))
    return tuple(modes)


_CONTAINERS = (list, tuple, dict, set, frozenset)
_UNWATCHED = object()
# The containers every module holds for itself (parameters, buffers, submodules, hooks): their
# contents are the module's structure, not settings.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


class _Containers:
    """Freezes list, tuple and dict attributes into values a signature can hold and compare,
    and records the mutable containers and tensors met, whose changes the next call must see."""

    def __init__(self, state_ids: frozenset[int]) -> None:
        self.state_ids = state_ids
        self.lists: list[list] = []
        self.dicts: list[dict] = []
        self.tensors: list[torch.Tensor] = []
        self.objects: dict[int, dict] = {}  # id of a plain object read -> its `__dict__`
        self.arrays: list[Any] = []
        self.sets: list[set] = []

    def frozen(self, value: object) -> object:
        """Plain values as themselves; a tensor by identity and version (a parameter or buffer
        as "state": it is an input of the graph, not a constant); a NumPy array by its bytes; a
        set of plain values by its contents; lists, tuples and dicts of these as tuples;
        `_UNWATCHED` if the container holds anything else (a module, a function, an object),
        which is not part of the signature (a module's tensors, read by the forward, are
        refused by the trace: `capture/trace.py`)."""
        if is_plain(value):
            return value
        if isinstance(value, torch.Tensor):
            if id(value) in self.state_ids:
                return ("state",)
            self.tensors.append(value)
            return ("tensor", id(value), version_of(value))
        if type(value) in (list, tuple):
            items = tuple(map(self.frozen, value))
            if _UNWATCHED in items:
                return _UNWATCHED
            if type(value) is list:
                self.lists.append(value)
            return (type(value).__name__, items)
        if type(value) is dict:
            pairs = tuple((key, self.frozen(item)) for key, item in value.items())
            if any(frozen is _UNWATCHED for _, frozen in pairs):
                return _UNWATCHED
            self.dicts.append(value)
            return ("dict", pairs)
        if type(value) in (set, frozenset) and all(map(is_plain, value)):
            if type(value) is set:  # compared at every call: changed in place, it is the same
                self.sets.append(value)
            return ("set", frozenset(value))
        if is_array(value):  # a trace bakes its values in
            if value.nbytes > ARRAY_BYTES:  # by identity: its bytes cost a copy at every call
                return ("array", id(value), value.dtype.str, value.shape)
            self.arrays.append(value)
            return ("array", id(value), value.dtype.str, value.shape, _contents(value))
        return _UNWATCHED


def _is_plain_object(value: object) -> bool:
    """An instance of a plain class holding settings (a config): attributes of its own, and not
    a container (a module's hook and parameter dicts), a module, a tensor, a type or a
    callable."""
    return (bool(getattr(value, "__dict__", None)) and not callable(value)
            and not isinstance(value, (dict, list, tuple, set, torch.nn.Module, torch.Tensor,
                                       type)))


# NumPy arrays up to this size are compared by their bytes at every call (a 64 MiB one cost
# 58 ms a call); larger ones by identity, a change in place unseen.
ARRAY_BYTES = 1 << 20


def _contents(array: Any) -> bytes:
    return array.tobytes()


_chain = itertools.chain.from_iterable
