"""The package's one kind of record: ``class X(Struct)`` or ``class X(Struct, frozen=True)``.

Fields are declared as in a dataclass (annotations, defaults, ``field(default_factory=...)``,
``__post_init__``), and a Struct behaves like one: keyword or positional construction, ``==`` by
class and field values, a ``Name(a=1, b=2)`` repr, hashing and no assignment when frozen, and
``replace`` / ``fields`` / ``asdict`` helpers. The shape follows msgspec's ``Struct``.

Why not ``dataclasses``: a dataclass compiles its methods from source when its class is defined,
about 0.5 ms a class and 1.2 ms a frozen one on CPython 3.11. Fourteen records load with the plugin
in every training process, and that alone used half of the 20 ms the plugin may add to a launch
(bench/startup.py). A Struct's methods are shared and read a per-class field table, so defining
a class costs microseconds. Type checkers see the fields through ``typing.dataclass_transform``.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from reprlib import recursive_repr
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

_T = TypeVar("_T")
_MISSING: Any = object()
_CLASS_VAR = ("ClassVar", "typing.ClassVar")
# Struct's own attributes: a field of the same name would break it, so none may be declared.
_RESERVED = frozenset({"_fields", "_defaults", "_frozen", "_values", "_hash", "_refuse_set", "_refuse_del"})


class FrozenStructError(AttributeError):
    """Assigning to (or deleting) a field of a frozen Struct."""


class _Factory:
    """A default made fresh for each instance (a mutable default must not be shared)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], Any]) -> Any:
    """A field whose default is ``default_factory()``, called for each instance."""
    return _Factory(default_factory)


def _no_transform(**_: Any) -> Callable[[_T], _T]:
    return lambda cls: cls


if TYPE_CHECKING:  # what checkers read: a plain import they recognise (typing has it from 3.11)
    from typing_extensions import dataclass_transform as _dataclass_transform
else:  # at run time: the standard library's where it has one, else nothing to tell
    _dataclass_transform = getattr(typing, "dataclass_transform", _no_transform)


def _is_class_var(annotation: Any) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text.split("[", 1)[0].strip() in _CLASS_VAR or annotation is ClassVar


@_dataclass_transform(field_specifiers=(field,))
class Struct:
    """Base of every record in the package; see the module docstring."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _frozen: ClassVar[bool] = False
    __match_args__: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, frozen: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherited = cls._frozen if cls._fields else None  # a parent with fields fixes frozen-ness
        if frozen is not None and inherited is not None and frozen != inherited:
            raise TypeError(f"{cls.__name__}: cannot be {'frozen' if frozen else 'mutable'} with a "
                            f"{'frozen' if inherited else 'mutable'} parent (as with dataclasses)")
        names = list(cls._fields)
        defaults = dict(cls._defaults)
        for name, annotation in cls.__annotations__.items():  # own ones only, from Python 3.10
            if _is_class_var(annotation):
                continue
            if name in _RESERVED:
                raise TypeError(f"{cls.__name__}.{name}: the name is Struct's own; choose another")
            if name not in names:
                names.append(name)
            if name not in cls.__dict__:
                defaults.pop(name, None)  # declared again without a default: it has none
                continue
            value = cls.__dict__[name]
            if type(value).__hash__ is None:  # as dataclasses (3.11+) judge "mutable"
                raise TypeError(f"{cls.__name__}.{name}: a mutable default is shared by every instance; "
                                f"use field(default_factory=...)")
            defaults[name] = value
            if isinstance(value, _Factory):
                delattr(cls, name)
        seen_default = ""
        for name in names:  # as for a function: no required field after one with a default
            if name in defaults:
                seen_default = name
            elif seen_default:
                raise TypeError(f"{cls.__name__}: field {name!r} without a default follows {seen_default!r}")
        cls._fields = tuple(names)
        cls._defaults = defaults
        cls._frozen = bool(inherited if frozen is None else frozen)
        cls.__match_args__ = cls._fields  # type: ignore[misc]  # mypy allows it only in a class body
        own = cls.__dict__
        # A class that defines __eq__ gets __hash__ = None from Python: that is not a choice of its own.
        if "__hash__" not in own or (own["__hash__"] is None and "__eq__" in own):
            cls.__hash__ = Struct._hash if cls._frozen else None  # type: ignore[assignment]
        # set on every class, so that neither a frozen parent nor a mutable one decides for a child
        # (checkers cannot type a method replaced per class: hence the two ignores)
        cls.__setattr__ = Struct._refuse_set if cls._frozen else object.__setattr__  # type: ignore[method-assign, assignment]
        cls.__delattr__ = Struct._refuse_del if cls._frozen else object.__delattr__  # type: ignore[method-assign, assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields_ = self._fields
        if len(args) > len(fields_):
            raise TypeError(f"{type(self).__name__}() takes {len(fields_)} positional arguments, {len(args)} given")
        values = dict(zip(fields_, args, strict=False))  # fewer args than fields: the rest by keyword
        for name, value in kwargs.items():
            if name not in fields_:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
            values[name] = value
        set_ = object.__setattr__
        for name in fields_:
            value = values.get(name, _MISSING)
            if value is _MISSING:
                value = self._defaults.get(name, _MISSING)
                if value is _MISSING:
                    raise TypeError(f"{type(self).__name__}() missing required argument {name!r}")
                if isinstance(value, _Factory):
                    value = value.make()
            set_(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    @recursive_repr()
    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__qualname__}({body})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Struct) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def _hash(self) -> int:
        return hash(self._values())

    def __replace__(self, **changes: Any) -> Any:  # copy.replace, Python 3.13+
        return replace(self, **changes)

    def _refuse_set(self, name: str, value: Any) -> None:
        raise FrozenStructError(f"cannot assign to field {name!r} of frozen {type(self).__name__}")

    def _refuse_del(self, name: str) -> None:
        raise FrozenStructError(f"cannot delete field {name!r} of frozen {type(self).__name__}")


def fields(struct: Struct | type[Struct]) -> tuple[str, ...]:
    """The field names of a Struct class or instance, in declaration order."""
    return struct._fields


def replace(struct: _T, **changes: Any) -> _T:
    """A copy of ``struct`` with ``changes`` (validated by the class as a new instance would be)."""
    values = {name: getattr(struct, name) for name in struct._fields}  # type: ignore[attr-defined]
    values.update(changes)
    return type(struct)(**values)


def asdict(value: Any) -> Any:
    """``value`` as plain data: Structs become dicts (recursively, as ``dataclasses.asdict`` does
    for dataclasses); lists and tuples (named ones too) keep their type; dicts keep their keys and
    come back as plain dicts. Other values are returned as they are, not copied."""
    if isinstance(value, Struct):
        return {name: asdict(getattr(value, name)) for name in value._fields}
    if isinstance(value, dict):
        return {k: asdict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items: Iterable[Any] = (asdict(v) for v in value)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
