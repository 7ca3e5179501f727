"""The module-level and class-level values a model's own code reads: part of its signature.

A trace runs the forward's Python once, so a module-level flag or number that the code reads
(`USE_AUX = step > 1000` set by the training script, `helpers.TEMPERATURE`) is a constant of the
graph, and reassigned at run time it served the old graph, silently wrong (torch.compile guards
on such globals). So the plain values (bool, int, float, str, None, dtype, tuples of them), the
tensors (by identity and version counter: class weights changed in place), the lists, tuples
and dicts of these (`CONFIG["scale"]`) and the plain attributes of settings objects (`args.scale`
of an argparse namespace, a config instance) that the user's code names are read at every call
(their contents frozen by `module_state`, as a module's own: changed in place after a build,
they served the old graph, silently wrong): the names in the code of every module class in the
tree (its methods and their nested functions), of the functions that code names, and the
attributes it names of the user's modules it names (`helpers.TEMPERATURE`; a function among
them, `helpers.scaled`, is read as the functions it names are). So are the class
attributes of the user's module classes (`Model.scale = 2.0` set by the script after a build
served the old graph, 8.4 off in a probe's output). Installed code (torch, transformers, the
standard library) is not read: its module-level values are the library's. Functions the code
names are watched by identity (`is_code`: `ACT = act_b` set by the script after a build served
the old graph, silently wrong), and so is the code of the user's classes it names (an
`autograd.Function`'s forward and backward, a helper class's static methods). NumPy scalars are
plain values (`np.exp(x)` is a `np.float64`). Other values (a class, a Python module) are not
watched; `names_read` lists every name, for what else needs them (`capture/python_random.py`: a
generator's method imported by name).
"""

from __future__ import annotations

import dis
import functools
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator, Mapping

import torch

_MISSING = object()
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class GlobalsRead:
    """Where each watched value lives (a namespace and a name) and how it is named."""

    def __init__(self, module: torch.nn.Module) -> None:
        found: dict[tuple[int, str], tuple[Mapping, str, str]] = {}
        named: set[str] = set()
        for namespace, name, label in _read_by(module, named):
            found.setdefault((id(namespace), name), (namespace, name, label))
        self._module, self._named = module, frozenset(named)
        # In label order: the same in every process (the disk index hashes them in this order).
        watched = sorted(found.values(), key=lambda entry: entry[2])
        self.namespaces = [namespace for namespace, _, _ in watched]
        self.names = [name for _, name, _ in watched]
        self.labels = [label for _, _, label in watched]

    @functools.cached_property
    def attribute_names(self) -> frozenset[str]:
        """Every name the model's code names: the user's code read above, and the code of the
        tree's classes (1.4 ms on a small BERT: made once asked, as the module state alone
        asks, not for the disk index's key or a build's globals)."""
        return self._named | _named_by_classes(self._module)

    def values(self) -> list[object]:
        """The watched values now (compared by identity with the last read's)."""
        return [namespace.get(name, _MISSING) for namespace, name in
                zip(self.namespaces, self.names)]

    def items(self) -> list[tuple[str, object]]:
        """(label, value) of the watched values now, tensors as themselves (the disk index
        hashes their contents)."""
        return [(label, code_label(value) if is_code(value) else value)
                for label, value in zip(self.labels, self.values()) if _watched(value)]

    def modes(self, values: list[object], freeze: Callable[[object], object]) -> tuple:
        """(label, value) of the watched values: a plain one or a function as itself (a
        function compares by identity); a tensor by identity and version counter (a trace
        bakes its values in); a container or a settings object as `freeze` makes it
        (`module_state`), left out where that is None."""
        modes = (
            (label, ("tensor", id(value), version_of(value)) if isinstance(value, torch.Tensor)
             else value if is_plain(value) or is_code(value) else freeze(value))
            for label, value in zip(self.labels, values) if _watched(value))
        return tuple((label, mode) for label, mode in modes if mode is not None)


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where installed packages and the standard library live: code there is named by its
    package's version (installing another version is what changes it), not read."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    # lazygrad itself: its code is in the index key through `disk_cache.versions`
    roots.add(os.path.dirname(os.path.abspath(__file__)))
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        roots.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


@functools.cache
def is_library(path: str) -> bool:
    """Whether the file at `path` is installed code (a package, the standard library, lazygrad).
    Cached per path: resolving links costs a system call per component (11 ms of a BERT-shaped
    model's first call, 134 functions read), and a file does not move between calls."""
    return os.path.realpath(path).startswith(_library_roots())


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter (-1 for an inference tensor, which has none and cannot be
    changed in place outside inference mode)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _watched(value: object) -> bool:
    return (is_plain(value) or isinstance(value, torch.Tensor) or is_settings(value)
            or is_code(value))


_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def is_code(value: object) -> bool:
    """A function (or a bound method, a builtin, a `functools.partial`): what a trace runs is
    decided by which one, so it is compared by identity."""
    return isinstance(value, _CODE)


def code_label(value: object) -> object:
    """A function as the same value in every process (the disk index hashes it): its module
    and qualified name (its source file is in the key), a partial's with its arguments."""
    if isinstance(value, functools.partial):
        keywords = tuple(sorted(value.keywords.items()))
        return ("partial", code_label(value.func), value.args, keywords)
    value = getattr(value, "__func__", value)
    return ("code", getattr(value, "__module__", None), getattr(value, "__qualname__", None))


def is_settings(value: object) -> bool:
    """A list, tuple, dict or set, or an instance of a plain class holding settings (a config, an
    argparse namespace): attributes of its own, and not a module, a tensor, a type, a
    callable or a Python module."""
    if type(value) in (list, tuple, dict, set, frozenset):
        return True
    return (bool(getattr(value, "__dict__", None)) and not callable(value)
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType)))


def is_plain(value: object) -> bool:
    """A value compared by equality: a bool, number, string, None, dtype or device, a NumPy
    scalar, or a tuple of them."""
    if type(value) in _PLAIN or _is_numpy_scalar(value):
        return True
    return type(value) is tuple and all(type(v) in _PLAIN or _is_numpy_scalar(v) for v in value)


def _is_numpy_scalar(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # not imported: no value is one
    return numpy is not None and isinstance(value, numpy.generic) and not isinstance(
        value, numpy.object_)


def is_array(value: object) -> bool:
    """A NumPy array (a trace bakes its values in, and it has no version counter)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _read_by(module: torch.nn.Module, named: set[str]) -> Iterator[tuple[Mapping, str, str]]:
    return ((namespace, name, label) for namespace, name, label in names_read(module, named)
            if _watched(namespace.get(name, _MISSING)))


def names_read(module: torch.nn.Module, named: set[str] | None = None
               ) -> Iterator[tuple[Mapping, str, str]]:
    """(namespace, name, label) of every value the user's code of the module tree reads: the
    class attributes of its classes (dunder names aside), the globals its code loads, and the
    attributes it names of the user's modules it loads. `named` (if given) gets every name that
    code names (`_names_in`)."""
    classes = {type(m) for m in module.modules()}
    for user_class in {base for klass in classes for base in _user_bases(klass)}:
        namespace = user_class.__dict__
        label = f"{user_class.__module__}.{user_class.__qualname__}"
        yield from ((namespace, name, f"{label}.{name}")
                    for name in namespace if not name.startswith("__"))
    functions = [function for klass in classes for function in _methods(klass)]
    functions += [function for m in module.modules() for function in functions_held(m)]
    seen: set[int] = set()
    while functions:
        function = functions.pop()
        if id(function) in seen or is_library(function.__code__.co_filename):
            continue
        seen.add(id(function))
        if function.__closure__:
            cells = _Cells(function)
            label = f"{function.__module__}.{function.__qualname__}"
            for name in function.__code__.co_freevars:
                yield cells, name, f"{label}.<{name}>"
                if isinstance(held := cells.get(name), types.FunctionType):
                    functions.append(held)
        namespace = function.__globals__
        names, global_names = set(), set()
        for code in _codes(function.__code__):
            names.update(code.co_names)
            global_names.update(_globals_loaded(code))
        if named is not None:
            named.update(_names_in(function))
        for name in global_names:
            value = namespace.get(name, _MISSING)
            yield namespace, name, f"{namespace.get('__name__')}.{name}"
            if isinstance(value, types.FunctionType):
                functions.append(value)
            elif isinstance(value, types.ModuleType) and getattr(value, "__file__", None) \
                    and not is_library(value.__file__):
                attributes = vars(value)
                yield from ((attributes, attribute, f"{value.__name__}.{attribute}")
                            for attribute in names if attribute in attributes)
                functions.extend(  # `helpers.scaled(self, x)`: its code too
                    function for attribute in names
                    if isinstance(function := attributes.get(attribute), types.FunctionType))
            elif isinstance(value, type) and not issubclass(value, torch.nn.Module) \
                    and next(_user_bases(value), None) is value:
                # A settings class (a notebook's `class CFG: temperature = 0.07`): its class
                # attributes, as a module class's (`CFG.scale` set after a build served the
                # old graph, 0.96 off in an output, silently); and its code (an
                # `autograd.Function`'s backward reading a global).
                attributes = value.__dict__
                yield from ((attributes, attribute, f"{value.__module__}.{value.__qualname__}"
                             f".{attribute}") for attribute in names if attribute in attributes)
                functions.extend(_methods(value))


class _Cells:
    """A function's closure read as a namespace: a free variable's name -> its cell's contents
    now (a hook's `cfg` dict, changed by the script after a build, served the old graph)."""

    def __init__(self, function: types.FunctionType) -> None:
        self._cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))

    def get(self, name: str, default: object = None) -> object:
        cell = self._cells.get(name)
        try:
            return default if cell is None else cell.cell_contents
        except ValueError:  # a cell not filled yet
            return default


def functions_held(module: torch.nn.Module) -> Iterator[types.FunctionType]:
    """The functions a module holds, which its calls run: its forward hooks and pre-hooks (a
    hook scaling an output by a setting it closes over), and functions kept as attributes (an
    instance `forward`, an activation kept as a lambda)."""
    held = [*module._forward_hooks.values(), *module._forward_pre_hooks.values(),
            *vars(module).values()]
    for value in held:
        value = getattr(value, "__func__", value)  # a bound method
        value = getattr(value, "func", value) if isinstance(value, functools.partial) else value
        if isinstance(value, types.FunctionType):
            yield value


def _user_bases(klass: type) -> Iterator[type]:
    """The classes of `klass`'s MRO below torch.nn.Module that the user's code defines."""
    for base in klass.__mro__:
        if base is torch.nn.Module or base is object:
            return
        source = getattr(sys.modules.get(base.__module__), "__file__", None)
        if source is None or not is_library(source):
            yield base


def _methods(klass: type) -> Iterator[types.FunctionType]:
    """The functions defined on the class and its bases, up to torch.nn.Module."""
    for base in klass.__mro__:
        if base is torch.nn.Module or base is object:
            return
        for value in vars(base).values():
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(function, types.FunctionType):
                yield function


def _named_by_classes(module: torch.nn.Module) -> set[str]:
    """Every name the code of the tree's module classes names, installed code included: their
    methods and those of their bases, `torch.nn.Module`'s too (`training`); and the methods of
    the objects the modules hold (`self.scorer.score(self, x)`)."""
    held = [value for m in module.modules() for value in vars(m).values()
            if hasattr(value, "__dict__") and not isinstance(
                value, (torch.Tensor, torch.nn.Module, type, types.ModuleType))]
    classes = {base for value in (*module.modules(), *held) for base in type(value).__mro__
               if base is not object}
    named: set[str] = set()
    for klass in classes:
        for value in vars(klass).values():
            if isinstance(value, property):
                functions = (value.fget, value.fset)
            elif isinstance(value, functools.cached_property):
                functions = (value.func,)
            else:
                functions = (getattr(value, "__func__", value),)  # staticmethod, classmethod
            for function in functions:
                if isinstance(function, types.FunctionType):
                    named.update(_names_in(function))
    return named


def _names_in(function: types.FunctionType) -> Iterator[str]:
    """The names a function's code (and the code nested in it) reads or writes as attributes or
    globals, and its strings (`getattr(self, "scale")`)."""
    for code in _codes(function.__code__):
        yield from code.co_names
        yield from (constant for constant in code.co_consts if type(constant) is str)


def _globals_loaded(code: types.CodeType) -> Iterator[str]:
    """The global names the code reads. Not all of `co_names`, which holds attribute names
    too: a script's global tensor named as an attribute the model reads (`mask` beside
    `self.mask`, a notebook's `a` beside `self.a`) was watched, and each step's new tensor
    made a new signature, so the model never ran through ORT."""
    return (instruction.argval for instruction in dis.get_instructions(code)
            if instruction.opname == "LOAD_GLOBAL")


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """The code object and those nested in it (lambdas, comprehensions, inner functions)."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)
