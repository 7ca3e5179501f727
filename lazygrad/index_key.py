"""The disk index's key: a hash of everything that decides what a trace produces, without tracing.

A new process that has to trace before it can look its graphs up (the traced graphs are the
disk cache's key) runs its first steps in eager PyTorch for seconds. What a trace produces is
decided by the module's code, its structure, its non-tensor attributes, the call's signature,
the policy, torch's default dtype and the library versions; all of these can be read and hashed
in milliseconds, so they key an index record naming the graphs an earlier process built, which
`Runtime` serves at once.

The code is hashed as the source files of every class in the module tree (each class's MRO up to
`torch.nn.Module`) and of every function held as an attribute, with the version of the package
each comes from, and as the source files of the modules these import (`_helper_files`), read
from their import statements, however deep, down to installed packages (each named by its
version). Code outside a library that the key reads is therefore in it: a changed helper file
misses the index before a step is served. (Graphs served and then confirmed by a trace in the
background did the same after the fact, with the trace's memory beside the steps: 100 MiB of
workload A's whole-process peak, `benchmarks/results/memory-targets.md`.) What the key cannot
see is a module-level variable that the training script reassigns at run time; docs/how-it-works.md
says so. Every value is hashed deterministically (the same bytes in every process) or not at all: a
value that cannot be (a closure of the user's code, a bound method, an object without
`__dict__`) makes the key None, and that signature gets no index; so does a global module hook
(`global_hooks.py`). A library's closure (a wrapper, as `torch._disable_dynamo`'s around
`torch.utils.checkpoint.checkpoint`) is hashed with what it holds, a `functools.partial` as its
function and arguments, a hook's handle not at all (the hook is hashed where the module holds
it), and hook dicts as their hooks in order, not by handle ids (a process-wide counter): a
model with gradient checkpointing got no key, and its second process ran its first steps
eagerly.
"""

from __future__ import annotations

import ast
import enum
import functools
import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.hooks import RemovableHandle

from lazygrad import attach, global_hooks
from lazygrad.code_globals import GlobalsRead, is_library

# A module's `__dict__` entries that are not hashed as values: its tensors and submodules
# (hashed as structure, or by the signature), hooks that never run in a forward, and lazygrad's
# own entries (its runtime; an instance `forward` routing to it is skipped by type: another
# instance `forward`, the user's, is hashed, or makes the key None).
_SKIPPED = frozenset({
    "_parameters", "_buffers", "_modules", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", attach.RUNTIME,
})
_BUDGET = 200_000  # values hashed per key at most: a huge attribute gets no index, not a slow call


class Unhashable(Exception):
    """A value with no deterministic hash: the signature gets no index record."""


def index_key(module: torch.nn.Module, signature: Any, state_names: Iterable[str],
              *parts: Any) -> str | None:
    """The key of a signature's index record, or None if something cannot be hashed
    deterministically. `parts`: the options that change the graphs, and the versions."""
    if any(global_hooks.registered()):  # how they run is the capture's to decide
        return None
    hasher = _Hasher(module)
    try:
        for name, submodule in module.named_modules(remove_duplicate=False):
            hasher.feed(("module", name, *_code(type(submodule))))
            hasher.code_modules.update(k.__module__ for k in type(submodule).__mro__)
            hasher.feed((list(submodule._parameters), list(submodule._buffers)))
            hasher.feed({k: v for k, v in _without_hook_ids(vars(submodule)).items()
                         if k not in _SKIPPED and not isinstance(v, attach.LazyForward)})
        hasher.feed(list(state_names))
        hasher.feed(GlobalsRead(module).items())
        hasher.feed((signature.grad, signature.autocast, signature.tensors, signature.constants,
                     signature.state, signature.state_layouts, signature.shapes, parts))
        hasher.feed_structure(signature.structure)
        hasher.feed(("helpers", _helper_files(hasher.code_modules), str(torch.get_default_dtype())))
    except Unhashable:
        return None
    except Exception:  # an object that fails to be read (a TorchScript module's attributes):
        return None  # not sure, so no key
    return hasher.digest.hexdigest()


# A module's hook dicts, by handle id (a process-wide counter: which hooks were registered
# before, anywhere), and the dicts of flags keyed by the same ids.
_HOOK_FLAGS = {"_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
               "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
               "_backward_hooks": (), "_backward_pre_hooks": ()}


def _without_hook_ids(attributes: dict) -> dict:
    """The module's attributes with each hook dict as its hooks in order, each with its flags:
    two processes that register the same hooks after different others get the same key."""
    found = dict(attributes)
    for name, flag_names in _HOOK_FLAGS.items():
        hooks = found.get(name)
        if not isinstance(hooks, dict):
            continue
        flags = [found.pop(flag_name, {}) for flag_name in flag_names]
        found[name] = [(hook, *(bool(flag.get(key)) for flag in flags))
                       for key, hook in hooks.items()]
    return found


def pair_key(key: str, mask: tuple[bool, ...] | None) -> str:
    """The key of the index record of one (signature, mask)."""
    return hashlib.sha256(repr((key, mask)).encode()).hexdigest()


def sizes_key(key: str) -> str:
    """The key of the record of which sizes were symbols for a signature (`key`: of the
    signature without its sizes)."""
    return hashlib.sha256(repr((key, "sizes")).encode()).hexdigest()


def _code(cls: type) -> list[tuple[str, str | None, str]]:
    """(qualified class name, its package's version, its source file's hash) along the MRO."""
    found = []
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            break
        found.append((f"{klass.__module__}.{klass.__qualname__}", _version(klass.__module__),
                      _source_hash(klass)))
    return found


def _version(module_name: str) -> str | None:
    package = sys.modules.get(module_name.partition(".")[0])
    version = getattr(package, "__version__", None)
    return version if isinstance(version, str) else None


def _source_hash(thing: Any) -> str:
    try:
        path = inspect.getsourcefile(thing)
    except TypeError:  # a builtin
        path = None
    if path is None:
        raise Unhashable(f"no source file for {thing!r}")
    return _file_hash(path)


def _helper_files(module_names: Iterable[str]) -> list[tuple[str, str]]:
    """(module name, source hash) of every module outside the installed libraries that the
    modules named import, directly or through each other, the named ones included."""
    found: dict[str, str] = {}
    queue = sorted(set(module_names))
    while queue:
        name = queue.pop()
        if name in found:
            continue
        try:
            path = _source_path(name)
        except Exception as error:  # a finder of the import system failing: not sure, no key
            raise Unhashable(f"cannot locate module {name}: {error}") from error
        if path is None or is_library(path):
            continue
        found[name] = _file_hash(path)
        package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
        queue.extend(_imported_names(path, package))
    return sorted(found.items())


def _source_path(name: str) -> str | None:
    """The Python source file of the module `name`, found without importing it (None: not a
    module, or not Python source)."""
    module = sys.modules.get(name)
    if module is not None:
        path = getattr(module, "__file__", None)
    else:
        spec = _spec(name)
        path = spec.origin if spec is not None and spec.has_location else None
    return path if isinstance(path, str) and path.endswith(".py") else None


def _spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """How the import system would load `name`, asked without importing it or its packages."""
    parent = name.rpartition(".")[0]
    where = None
    if parent:
        outer = sys.modules.get(parent)
        if outer is not None:
            where = getattr(outer, "__path__", None)
        else:
            spec = _spec(parent)
            where = None if spec is None else spec.submodule_search_locations
        if where is None:  # the parent is not a package: `name` is an attribute of it
            return None
    try:
        return importlib.machinery.PathFinder.find_spec(name, where)
    except (ImportError, ValueError):  # no such module: an import of it cannot run either
        return None


@functools.cache
def _imported_names(path: str, package: str) -> tuple[str, ...]:
    """Every module an import statement of the file may name, anywhere in it (a function's own
    imports too): `from a import b` names `a` and `a.b`, which is a module or an attribute."""
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), path)
    except (OSError, SyntaxError, ValueError) as error:
        raise Unhashable(f"cannot read {path}: {error}") from error
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except (ImportError, ValueError):
                    continue
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return tuple(names)


@functools.cache
def _file_hash(path: str) -> str:
    """Read once per process: the code that runs is the code that was loaded."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError as error:
        raise Unhashable(str(error)) from error


_PLAIN = (type(None), bool, int, float, str, bytes, complex)
_NAMED = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)


class _Hasher:
    """Feeds values into one SHA-256, each tagged with its type so no two values collide."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.digest = hashlib.sha256()
        self._budget = _BUDGET
        self._seen: dict[int, int] = {}  # id -> order of first visit: a back-reference
        self._held: list[Any] = []  # keeps the ids above unique while hashing
        self._modules = {id(m): name for name, m in root.named_modules()}
        self.code_modules: set[str] = set()  # modules whose code the key holds: see `_helper_files`

    def _put(self, *items: Any) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise Unhashable("too many values")
        self.digest.update(repr(items).encode())
        self.digest.update(b"\0")

    def feed(self, value: Any) -> None:
        kind = type(value)
        if isinstance(value, enum.Enum):
            self._put("enum", _name(kind))
            self.feed(value.value)
        elif isinstance(value, _PLAIN) or kind in _NAMED:
            # A subclass of a plain type (torch's version string) by its plain value.
            self._put(_name(kind), value if kind in _PLAIN else str(value))
        elif isinstance(value, type):
            self._put("type", _name(value))
        elif isinstance(value, types.BuiltinFunctionType):
            self._put("builtin", value.__module__, value.__qualname__)
        elif isinstance(value, torch.nn.Module):
            if id(value) not in self._modules:
                raise Unhashable("a module outside the tree")
            self._put("submodule", self._modules[id(value)])
        elif isinstance(value, torch.Tensor):
            plain = value.detach().cpu().contiguous()
            self._put("tensor", str(plain.dtype), tuple(plain.shape))
            self.digest.update(plain.view(-1).view(torch.uint8).numpy().tobytes())
        elif id(value) in self._seen:
            self._put("seen", self._seen[id(value)])
        else:
            self._seen[id(value)] = len(self._seen)
            self._held.append(value)
            self._feed_container(value)

    def _feed_container(self, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            self._put(_name(type(value)), len(value))
            for item in value:
                self.feed(item)
        elif isinstance(value, dict):
            self._put(_name(type(value)), len(value))
            for key, item in value.items():
                self.feed(key)
                self.feed(item)
        elif isinstance(value, (set, frozenset)) and all(type(v) in _PLAIN for v in value):
            self._put("set", sorted(map(repr, value)))
        elif isinstance(value, types.FunctionType):
            wrapper = is_library(value.__code__.co_filename)  # a library's closure: a wrapper
            if value.__closure__ is not None and not wrapper:
                raise Unhashable(f"a closure: {value.__qualname__}")
            self.code_modules.add(value.__module__)
            self._put("function", value.__module__, value.__qualname__,
                      value.__code__.co_firstlineno, _source_hash(value))
            self.feed((value.__defaults__, value.__kwdefaults__))
            if value.__closure__ is not None:  # what it wraps (`torch._disable_dynamo`'s)
                self.feed([cell.cell_contents for cell in value.__closure__])
        elif isinstance(value, RemovableHandle):  # a hook's handle: the hook is hashed as held
            self._put("hook handle")
        elif isinstance(value, functools.partial):  # transformers' checkpointing function
            self._put("partial")
            self.feed((value.func, value.args, value.keywords))
        elif _python_object(value):
            cls = type(value)
            self.code_modules.update(k.__module__ for k in cls.__mro__)
            self._put("object", _name(cls), _version(cls.__module__), _source_hash(cls))
            self.feed(vars(value))
        else:
            raise Unhashable(f"a {type(value).__name__}")

    def feed_structure(self, spec: pytree.TreeSpec) -> None:
        """A call's argument structure: node types, contexts (dict keys, field names), leaves."""
        if spec.is_leaf():
            self._put("leaf")
            return
        self._put("node", _name(spec.type), len(spec.children()))
        self.feed(spec.context)
        for child in spec.children():
            self.feed_structure(child)


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a class written in C, not Python


def _python_object(value: Any) -> bool:
    """Whether the object's state is its `__dict__`: an instance of classes written in Python
    (a C class such as `functools.partial` keeps its state elsewhere)."""
    return hasattr(value, "__dict__") and not any(
        klass.__flags__ & _IMMUTABLE_TYPE for klass in type(value).__mro__[:-1]
    )


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

