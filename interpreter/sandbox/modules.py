"""The modules a cell may import, served as read-only facades.

``import`` is limited to :data:`~.surface.ALLOWED_MODULES` (pure computation). Each import
returns a :class:`SandboxModule` holding only the names surface.py exposes for the module
(never submodules or mutable module state), each admitted (admission.py): its Python functions
are held as :class:`~.provenance.SandboxFunction` objects (no ``__globals__`` to read), whose
results are admitted deeply unless the module only returns plain data; the functions that
evaluate strings, look up attributes by name, generate source from names or write into their
arguments are removed (surface.py) or replaced here by vetted versions (the table in
docs/sandbox.md). The vetted class factories record the classes they make in the sandbox's
provenance, and ``copy`` is the sandbox's own (copying.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import importlib
import keyword
import operator
import pprint
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from .admission import AdmissionError
from .classes import ALLOWED_BASE_IDS, allowed_base
from .copying import Copier, copy_functions
from .guards import Guards
from .output import SandboxContext
from .policy import SANDBOX_MODULE_NAME, check_attribute_name
from .provenance import Provenance, SandboxFunction
from .surface import ALLOWED_MODULES, exposed_names, exposure, mutable_module_value

INTERNAL_IMPORTS = frozenset({"_strptime"})
"""Modules the C code of allowed modules imports at call time through the ``__import__`` of the
calling frame, which is the cell's (``datetime.strptime`` imports ``_strptime``): imported for
that code, never handed to the cell."""


# --------------------------------------------------------------------------- vetted functions

def _safe_attrgetter(guards: Guards) -> Callable[..., Callable[[Any], Any]]:
    def attrgetter(*names: str) -> Callable[[Any], Any]:
        """``operator.attrgetter`` whose lookups go through the sandbox's guards."""
        for name in names:
            for part in str(name).split("."):
                check_attribute_name(None, part)

        def resolve(obj: Any, dotted: str) -> Any:
            for part in dotted.split("."):
                obj = guards.getattr(obj, part)
            return obj

        if len(names) == 1:
            return lambda obj: resolve(obj, names[0])
        return lambda obj: tuple(resolve(obj, name) for name in names)

    return attrgetter


def _safe_item_functions(guards: Guards) -> dict[str, Callable[..., Any]]:
    """``operator.getitem`` and ``operator.itemgetter`` whose lookups go through the guard:
    what ``obj[key]`` gives is admitted, as ``x[k]`` in cell code is. C code calls them
    where no door sees the result (``map(operator.getitem, [typing.Annotated], [(f, 0)])``
    built an alias over any callable, and calling one writes ``__orig_class__`` into what the
    callable returns: a stdlib class)."""

    def getitem(obj: Any, key: Any, /) -> Any:
        """``obj[key]``, admitted."""
        return guards.getitem(obj, key)

    def itemgetter(*items: Any) -> Callable[[Any], Any]:
        """``operator.itemgetter`` whose lookups go through the sandbox's guard."""
        if not items:
            raise TypeError("itemgetter expected 1 argument, got 0")
        if len(items) == 1:
            item = items[0]
            return lambda obj: guards.getitem(obj, item)
        return lambda obj: tuple(guards.getitem(obj, item) for item in items)

    return {"getitem": getitem, "itemgetter": itemgetter}


def _safe_methodcaller(guards: Guards) -> Callable[..., Callable[[Any], Any]]:
    def methodcaller(name: str, /, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        """``operator.methodcaller`` whose lookup goes through the sandbox's guards."""
        check_attribute_name(None, name)
        return lambda obj: guards.getattr(obj, name)(*args, **kwargs)

    return methodcaller


def check_field_names(names: Any, what: str, allowed: tuple[str, ...] = ()) -> None:
    """Raise unless every name is a public identifier (class factories put names into
    generated source or set them as attributes)."""
    for name in names:
        if name in allowed:
            continue
        if type(name) is not str or not name.isidentifier() or keyword.iskeyword(name) \
                or name.startswith("_"):
            raise TypeError(f"{what}: {name!r} is not allowed in the sandbox (names must be "
                            "identifiers that do not start with '_')")


def _safe_update_wrapper(context: SandboxContext, wrapper: Any, wrapped: Any,
                         assigned: Any = functools.WRAPPER_ASSIGNMENTS,
                         updated: Any = functools.WRAPPER_UPDATES) -> Any:
    """``functools.update_wrapper`` onto a function or instance defined in the sandbox,
    copying only strings, public annotations and public attributes. Every value it copies is
    admitted first, as the builtin ``setattr`` admits what it writes: ``wrapped.__dict__`` is
    whatever object the cell passed (a ``json.JSONDecoder`` holds the module's scanner and
    inner parser functions under public names), read with no door on the way."""
    provenance, admit = context.provenance, context.admission.admit
    if (tuple(assigned), tuple(updated)) != (functools.WRAPPER_ASSIGNMENTS,
                                             functools.WRAPPER_UPDATES):
        raise ValueError("custom 'assigned'/'updated' attributes are not supported in the sandbox")
    if isinstance(wrapper, type) or not provenance.made(wrapper):
        raise TypeError("functools.update_wrapper: the wrapper must be a function or an "
                        "instance defined in the sandbox")
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        value = getattr(wrapped, name, None)
        if type(value) is str or (name == "__doc__" and value is None):
            setattr(wrapper, name, value)
    annotations = getattr(wrapped, "__annotations__", None)
    if isinstance(annotations, dict):
        annotations = dict(annotations)  # a snapshot: a dict subclass's own items() is not called
        check_field_names(list(annotations), "functools.update_wrapper", allowed=("return",))
        wrapper.__annotations__ = {key: admit(value) for key, value in annotations.items()}
    extra = getattr(wrapped, "__dict__", None)
    if isinstance(extra, dict):
        for name, value in list(dict.items(extra)):
            if type(name) is str and name.isidentifier() and not name.startswith("_"):
                setattr(wrapper, name, admit(value))
    wrapper.__wrapped__ = admit(wrapped)  # C code may call this with an object no door saw
    return wrapper


def _wrap_functions(context: SandboxContext) -> Mapping[str, Any]:
    """``functools.update_wrapper`` and ``functools.wraps`` onto sandbox objects only."""

    def update_wrapper(wrapper: Any, wrapped: Any, assigned: Any = functools.WRAPPER_ASSIGNMENTS,
                       updated: Any = functools.WRAPPER_UPDATES) -> Any:
        return _safe_update_wrapper(context, wrapper, wrapped, assigned, updated)

    def wraps(wrapped: Any, assigned: Any = functools.WRAPPER_ASSIGNMENTS,
              updated: Any = functools.WRAPPER_UPDATES) -> Callable[[Any], Any]:
        return lambda wrapper: update_wrapper(wrapper, wrapped, assigned, updated)

    return {"update_wrapper": update_wrapper, "wraps": wraps}


def _writing_to_argument(function: Callable[..., Any], guards: Guards) -> Callable[..., Any]:
    """Wrap a decorator that sets attributes on its argument: only on sandbox objects."""

    @functools.wraps(function)
    def decorate(target: Any, *args: Any, **kwargs: Any) -> Any:
        return function(guards.write(target), *args, **kwargs)

    return decorate


def _check_dataclass_fields(target: type, provenance: Provenance) -> None:
    """Raise unless every class ``target`` derives from was made by the sandbox (or is an
    allowed real base without dataclass fields) and every field ``dataclass`` would read (its
    own annotations, every base's dataclass fields) has a public identifier for a name:
    dataclasses writes source code from them. Which classes count is decided by identity."""
    for cls in target.__mro__:
        namespace = type.__dict__["__dict__"].__get__(cls)
        if id(cls) in ALLOWED_BASE_IDS and "__dataclass_fields__" not in namespace:
            continue  # a real class of the fixed allow-list: no dataclass fields
        if not provenance.made_class(cls):
            raise TypeError(f"dataclass(): {cls.__qualname__!r} was not defined in the sandbox")
        annotations = namespace.get("__annotations__", {})
        fields = namespace.get("__dataclass_fields__", {})
        if type(annotations) is not dict or type(fields) is not dict:
            raise TypeError(f"dataclass(): {cls.__qualname__!r} has crafted annotations")
        check_field_names(dict.keys(annotations), "dataclass field")
        for key, field in dict.items(fields):
            if type(field) is not dataclasses.Field or field.name != key:
                raise TypeError(f"dataclass(): {cls.__qualname__!r} has crafted fields")
            check_field_names([key], "dataclass field")


def _safe_dataclass(provenance: Provenance) -> Callable[..., Any]:
    """``dataclasses.dataclass`` for classes made by the sandbox (bases included) whose fields,
    inherited ones too, have public identifiers for names."""

    def dataclass(cls: Any = None, /, **options: Any) -> Any:
        def wrap(target: Any) -> Any:
            if not isinstance(target, type):
                raise TypeError("dataclass() applies only to classes defined in the sandbox")
            _check_dataclass_fields(target, provenance)
            return provenance.record(dataclasses.dataclass(target, **options))

        return wrap if cls is None else wrap(cls)

    return dataclass


def _safe_replace(context: SandboxContext) -> Callable[..., Any]:
    provenance, admit = context.provenance, context.admission.admit

    def replace(obj: Any, /, **changes: Any) -> Any:
        """``dataclasses.replace`` for dataclass instances the sandbox made (it reads every
        field's name and value off the object). The values it reads are admitted first: it
        hands them to the class's ``__init__``, which may be a stdlib base's calling an
        attribute the cell chose (``UserDict.__init__`` calls ``self.update``)."""
        if isinstance(obj, type) or not provenance.made(obj) or not dataclasses.is_dataclass(obj):
            raise TypeError("replace() applies to instances of dataclasses defined in the "
                            "sandbox")
        _check_dataclass_fields(type(obj), provenance)
        for field in dataclasses.fields(obj):
            if field.init and field.name not in changes:
                changes[field.name] = admit(getattr(obj, field.name))
        return dataclasses.replace(obj, **changes)

    return replace


def _fields_as(copier: Copier, factory_name: str, pairs: bool) -> Callable[..., Any]:
    """``dataclasses.asdict`` (``pairs``) or ``astuple``, copying leaf values with the
    sandbox's own ``copy.deepcopy``. Every value it reads off the object (field values, the
    items of containers) is admitted before anything else sees it: the factory is the cell's
    own callable (``dict_factory=box.extend``), and a field can name what a stdlib base's
    ``__init__`` stored (``JSONDecoder``'s ``parse_object``)."""
    admit = copier.admission.admit

    def convert(obj: Any, factory: Callable[[list[Any]], Any]) -> Any:
        obj = admit(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            values = [(field.name, convert(getattr(obj, field.name), factory))
                      for field in dataclasses.fields(obj)]
            return factory(values if pairs else [value for _, value in values])
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*[convert(value, factory) for value in obj])
        if isinstance(obj, (list, tuple)):
            return type(obj)(convert(value, factory) for value in obj)
        if isinstance(obj, dict):
            return type(obj)((convert(key, factory), convert(value, factory))
                             for key, value in obj.items())
        return copier.deepcopy(obj)

    def fields_as(obj: Any, **options: Any) -> Any:
        factory = options.pop(factory_name, dict if pairs else tuple)
        if options:
            raise TypeError(f"unexpected arguments: {', '.join(options)}")
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"{'asdict' if pairs else 'astuple'}() should be called on "
                            "dataclass instances")
        return convert(obj, factory)

    fields_as.__name__ = fields_as.__qualname__ = "asdict" if pairs else "astuple"
    return fields_as


def _safe_namedtuple(context: SandboxContext) -> Callable[..., type]:
    def namedtuple(typename: str, field_names: Any, *, rename: bool = False,
                   defaults: Any = None, module: Any = None) -> type:
        """``collections.namedtuple``, always owned by the sandbox (no ``module=``)."""
        if module is not None:
            raise ValueError("namedtuple(module=...) is not supported in the sandbox")
        return context.provenance.record(collections.namedtuple(
            typename, field_names, rename=rename, defaults=defaults,
            module=SANDBOX_MODULE_NAME))

    return namedtuple


def _exact_str(value: Any) -> Any:
    """A ``str`` subclass instance as a plain ``str`` (its own methods are never called)."""
    return "".join([value]) if isinstance(value, str) else value


def _member_names(names: Any) -> tuple[Any, list[Any]]:
    """A snapshot of an Enum functional-API ``names`` argument, made of plain strings (read
    once: a ``str`` subclass's own ``split`` or ``replace`` would answer differently the
    next time), and the names in it."""
    if isinstance(names, str):
        keys = _exact_str(names).replace(",", " ").split()
        return keys, list(keys)
    if isinstance(names, Mapping):
        snapshot = {_exact_str(key): value for key, value in dict(names).items()}
        return snapshot, list(snapshot)
    items: list[Any] = []
    for item in list(names):
        if isinstance(item, str):
            items.append(_exact_str(item))
        else:
            pair = tuple(item)
            if len(pair) != 2:
                raise TypeError("Enum members must be names or (name, value) pairs")
            items.append((_exact_str(pair[0]), pair[1]))
    return items, [item if type(item) is str else item[0] for item in items]


def _sandbox_enum(base: type, context: SandboxContext) -> type:
    """A subclass of enum class ``base`` whose functional API (``Enum('E', names)``)
    refuses private and dunder names, which would become arbitrary class attributes, a
    ``type=`` mix-in the sandbox may not derive from, and ``module=`` / ``qualname=``."""
    provenance = context.provenance

    def create(cls: Any, class_name: Any, names: Any, **options: Any) -> Any:
        names, keys = _member_names(names)
        check_field_names(keys, "Enum member name")
        values = names.values() if isinstance(names, dict) else \
            [item[1] for item in names if type(item) is tuple]
        for value in values:  # a descriptor becomes a class attribute, not a member
            if not context.admission.admissible(value):
                raise TypeError(f"Enum member value {type(value).__name__!r}: not an object "
                                "the sandbox may hold")
        for option in ("module", "qualname"):
            if options.pop(option, None) is not None:
                raise ValueError(f"Enum(..., {option}=...) is not supported in the sandbox")
        mixin = options.get("type")
        if mixin is not None and not allowed_base(provenance, mixin):
            raise TypeError("Enum(..., type=...): the sandbox cannot derive from that class")
        return provenance.record(real_create.__func__(
            cls, _exact_str(class_name), names, module=SANDBOX_MODULE_NAME, **options))

    real_create = base._create_
    safe = types.new_class(base.__name__, (base,), exec_body=lambda ns: ns.update(
        {"__module__": base.__module__, "__qualname__": base.__qualname__}))
    safe._create_ = classmethod(create)
    provenance.vet_base(safe)
    return safe


def _recording(factory: Callable[..., Any], context: SandboxContext) -> SandboxFunction:
    """A class factory of the stdlib (``typing.NamedTuple('P', [...])``) whose classes are
    recorded as made by the sandbox (the factory checks the names it writes); the factory
    itself stays what the class builder knows as a base (`~.provenance.unwrap`)."""

    def record(made: Any) -> Any:
        if isinstance(made, type):
            made.__module__ = SANDBOX_MODULE_NAME  # not the module of the frame that called
        return context.admission.admit(context.provenance.record(made))

    return SandboxFunction(factory, record)


def _safe_dataclass_transform(guards: Guards) -> Callable[..., Callable[[Any], Any]]:
    def dataclass_transform(**options: Any) -> Callable[[Any], Any]:
        """``typing.dataclass_transform``: its decorator marks only objects the sandbox made."""
        return _writing_to_argument(typing.dataclass_transform(**options), guards)

    return dataclass_transform


def _reveal_type(context: SandboxContext) -> Callable[[Any], Any]:
    def reveal_type(obj: Any, /) -> Any:
        """``typing.reveal_type``, printing to the cell's output instead of stderr."""
        context.write(f"Runtime type is {type(obj).__name__!r}\n")
        return obj

    return reveal_type


def _sandbox_pprint(context: SandboxContext) -> Callable[..., None]:
    def pprint_to_output(obj: Any, *args: Any, **kwargs: Any) -> None:
        """``pprint.pprint``, printing to the cell's output."""
        kwargs.pop("stream", None)
        context.write(pprint.pformat(obj, *args, **kwargs) + "\n")

    return pprint_to_output


# --------------------------------------------------------------------------- facades

_ENUM_CLASSES = ("Enum", "IntEnum", "Flag", "IntFlag", "StrEnum")

_REPLACEMENTS: dict[str, Callable[[SandboxContext], Mapping[str, Any]]] = {
    "typing": lambda context: {
        **{name: _recording(getattr(typing, name), context)
           for name in ("NamedTuple", "TypedDict")},
        "reveal_type": _reveal_type(context),
        "dataclass_transform": _safe_dataclass_transform(context.guards),
        **{name: _writing_to_argument(getattr(typing, name), context.guards)
           for name in ("final", "no_type_check", "runtime_checkable")}},
    "functools": lambda context: {
        **_wrap_functions(context),
        "total_ordering": _writing_to_argument(functools.total_ordering, context.guards)},
    "copy": lambda context: copy_functions(context.admission),
    "operator": lambda context: {
        "attrgetter": _safe_attrgetter(context.guards),
        "methodcaller": _safe_methodcaller(context.guards),
        **_safe_item_functions(context.guards),
        **{name: _writing_to_argument(getattr(operator, name), context.guards)
           for name in ("setitem", "delitem")}},
    "collections": lambda context: {"namedtuple": _safe_namedtuple(context)},
    "enum": lambda context: {name: _sandbox_enum(getattr(enum, name), context)
                             for name in _ENUM_CLASSES if hasattr(enum, name)},
    "dataclasses": lambda context: {
        "dataclass": _safe_dataclass(context.provenance),
        "replace": _safe_replace(context),
        "asdict": _fields_as(Copier(context.admission), "dict_factory", pairs=True),
        "astuple": _fields_as(Copier(context.admission), "tuple_factory", pairs=False)},
    "pprint": lambda context: {"pprint": _sandbox_pprint(context),
                               "pp": _sandbox_pprint(context)},
}
"""The vetted replacements (and additions) of each module's functions, for one sandbox."""

_CALLABLE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                   functools.partial)


def _facade_value(value: Any, plain_results: bool, context: SandboxContext) -> Any:
    """A module attribute as its facade holds it, admitted: a Python function becomes a
    :class:`~.provenance.SandboxFunction` whose results are admitted deeply unless the module
    returns only plain data; a C function is made known to admission (by identity)."""
    admission = context.admission
    if type(value) is types.BuiltinFunctionType:
        admission.know_function(value)
    elif isinstance(value, _CALLABLE_TYPES):
        return SandboxFunction(value, None if plain_results else admission.admit_deep)
    return admission.admit(value)


class SandboxModule:
    """A read-only view of an allowed module: only its vetted public attributes."""

    __slots__ = ("_name", "_attributes")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attributes", attributes)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._attributes[name]
        except KeyError:
            raise AttributeError(
                f"module {self._name!r} has no attribute {name!r} in the sandbox") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"module {self._name!r} is read-only in the sandbox")

    __delattr__ = __setattr__  # type: ignore[assignment]

    def __dir__(self) -> list[str]:
        return sorted(self._attributes)

    def __repr__(self) -> str:
        return f"<module {self._name!r} (sandbox)>"


def module_facade(context: SandboxContext, name: str) -> SandboxModule:
    """The sandbox view of allowed module ``name`` (built once per sandbox)."""
    facade = context.facades.get(name)
    if facade is not None:
        return facade
    if name not in ALLOWED_MODULES:
        raise ImportError(f"module {name!r} is not available in the sandbox")
    module = importlib.import_module(name)
    plain_results = exposure(name).plain_results
    attributes: dict[str, Any] = {}
    values = {attr: getattr(module, attr, _MISSING) for attr in exposed_names(name, module)}
    replace = _REPLACEMENTS.get(name)
    values.update(replace(context) if replace is not None else {})
    for attr, value in values.items():
        if value is _MISSING or mutable_module_value(value):
            continue
        try:
            attributes[attr] = _facade_value(value, plain_results, context)
        except AdmissionError:
            continue  # nothing the sandbox may hold
    prefix = name + "."
    for submodule in ALLOWED_MODULES:
        if submodule.startswith(prefix) and "." not in submodule[len(prefix):]:
            attributes[submodule[len(prefix):]] = module_facade(context, submodule)
    facade = context.facades[name] = SandboxModule(name, attributes)
    return facade


_MISSING: Any = object()


def guarded_import(context: SandboxContext) -> Callable[..., SandboxModule | None]:
    """The sandbox's ``__import__``: limited to :data:`ALLOWED_MODULES`."""

    def sandbox_import(name: str, globals: Any = None, locals: Any = None,
                       fromlist: Any = (), level: int = 0) -> SandboxModule | None:
        if level != 0:
            raise ImportError("relative imports are not available in the sandbox")
        if type(name) is str and name in INTERNAL_IMPORTS:
            importlib.import_module(name)  # for the C code that asked: it reads sys.modules
            return None
        if type(name) is not str or name not in ALLOWED_MODULES:
            allowed = ", ".join(sorted(ALLOWED_MODULES))
            raise ImportError(
                f"import of {name!r} is not allowed in the sandbox; allowed modules: {allowed}")
        return module_facade(context, name if fromlist else name.partition(".")[0])

    sandbox_import.__name__ = sandbox_import.__qualname__ = "__import__"
    return sandbox_import


__all__ = ["ALLOWED_MODULES", "INTERNAL_IMPORTS", "SandboxModule", "check_field_names",
           "guarded_import", "module_facade"]
