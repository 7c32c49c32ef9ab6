"""core/struct.py: the package's one record type behaves as the dataclass it replaces, and the
package defines no record any other way."""

from __future__ import annotations

import ast
import copy
import pickle
from typing import ClassVar

import pytest
from conftest import REPO

from megatron_perf_toggles.core.struct import FrozenStructError, Struct, asdict, field, fields, replace


class Point(Struct, frozen=True):
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()


class Bag(Struct):
    name: str
    items: list[int] = field(default_factory=list)
    seen: int = 0

    def __post_init__(self) -> None:
        self.seen = len(self.items)


class Point3(Point):
    z: int = 0


class Counted(Struct, frozen=True):
    made: ClassVar[int] = 0  # a class constant, not a field
    n: int = 0


class Node(Struct):
    name: str
    next: Node | None = None


class Keyed(Struct, frozen=True):
    k: int

    def __eq__(self, other: object) -> bool:  # its own equality; hashing stays the Struct's
        return isinstance(other, Keyed) and self.k == other.k


def test_construction_positional_keyword_and_defaults():
    assert Point(1).y == 0 and Point(1, 2).y == 2 and Point(x=1, y=3).y == 3
    assert fields(Point) == ("x", "y", "tags") and fields(Point(1)) == ("x", "y", "tags")
    assert Point3(1, 2, z=5).z == 5 and fields(Point3) == ("x", "y", "tags", "z")


@pytest.mark.parametrize("make, words", [
    (lambda: Point(), "missing required argument 'x'"),
    (lambda: Point(1, 2, (), 4), "takes 3 positional arguments, 4 given"),
    (lambda: Point(1, w=2), "unexpected keyword argument 'w'"),
    (lambda: Point(1, x=2), "multiple values for argument 'x'"),
])
def test_bad_construction_is_a_type_error_naming_the_argument(make, words):
    with pytest.raises(TypeError, match=words):
        make()


def test_factories_are_fresh_per_instance_and_post_init_runs():
    a, b = Bag("a"), Bag("b", [1, 2])
    a.items.append(1)
    assert Bag("c").items == [] and b.seen == 2
    assert "items" not in Bag.__dict__  # the factory is not left on the class


def test_equality_hash_and_repr_as_a_dataclass():
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)
    assert Point(1) != Point3(1)  # another class is never equal
    assert len({Point(1, 2), Point(1, 2)}) == 1
    assert repr(Point(1, tags=("a",))) == "Point(x=1, y=0, tags=('a',))"
    with pytest.raises(TypeError):
        hash(Bag("a"))  # mutable: unhashable, as a non-frozen dataclass with eq


def test_frozen_refuses_assignment_and_mutable_allows_it():
    p = Point(1)
    with pytest.raises(FrozenStructError):
        p.x = 2
    with pytest.raises(AttributeError):  # FrozenStructError is an AttributeError, as dataclasses'
        del p.y
    bag = Bag("a")
    bag.name = "b"
    assert bag.name == "b"
    with pytest.raises(FrozenStructError):
        Point3(1).z = 2  # a frozen parent's child is frozen
    assert hash(Keyed(1)) == hash(Keyed(1))  # a frozen class with its own __eq__ stays hashable


def test_replace_asdict_copy_and_pickle():
    p = Point(1, 2, ("t",))
    q = replace(p, y=5)
    assert (q.x, q.y, q.tags) == (1, 5, ("t",)) and p.y == 2
    with pytest.raises(TypeError):
        replace(p, w=1)
    nested = Bag("n", [1])
    assert asdict({"p": [p], "b": nested}) == {"p": [{"x": 1, "y": 2, "tags": ("t",)}],
                                               "b": {"name": "n", "items": [1], "seen": 1}}
    assert copy.copy(p) == p and pickle.loads(pickle.dumps(p)) == p
    bag = Bag("b", [1, 2])
    deep = copy.deepcopy(bag)
    assert deep == bag and deep.items is not bag.items
    again = pickle.loads(pickle.dumps(bag))
    assert again == bag and again.seen == 2
    assert copy.replace(p, x=9).x == 9 if hasattr(copy, "replace") else True  # Python 3.13+


def test_class_constants_match_args_and_recursive_repr():
    assert fields(Counted) == ("n",) and Counted.made == 0
    with pytest.raises(TypeError):
        Counted(1, 2)  # made is not a parameter
    assert Point.__match_args__ == ("x", "y", "tags")
    match Point(3, 4):
        case Point(x, y):
            assert (x, y) == (3, 4)
    loop = Node("a")
    loop.next = loop
    assert repr(loop) == "Node(name='a', next=...)"  # a cycle is named, not recursed into


def test_declaration_errors_are_raised_when_the_class_is_defined():
    with pytest.raises(TypeError, match="mutable default"):
        class Shared(Struct):
            items: list = []  # noqa: RUF012
    with pytest.raises(TypeError, match="mutable default"):
        class SharedBag(Struct):
            bag: Bag = Bag("x")  # an unhashable record is mutable too
    with pytest.raises(TypeError, match="without a default follows"):
        class Order(Struct):
            a: int = 0
            b: int
    with pytest.raises(TypeError, match="Struct's own"):
        class Clash(Struct):
            _values: int = 0
    with pytest.raises(TypeError, match="mutable parent"):
        class FrozenOfMutable(Bag, frozen=True):
            extra: int = 0
    with pytest.raises(TypeError, match="frozen parent"):
        class MutableOfFrozen(Point, frozen=False):
            extra: int = 0


def test_a_field_declared_again_without_a_default_has_none():
    class Base(Struct):
        a: int = 1

    class Child(Base):
        a: int  # type: ignore[misc]

    with pytest.raises(TypeError, match="missing required argument 'a'"):
        Child()
    assert Child(2).a == 2 and Base().a == 1


def _record_styles_other_than_struct(path, source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "dataclasses" and any(
                a.name in ("dataclass", "make_dataclass") for a in node.names):
            found.append(f"{path}: imports {', '.join(a.name for a in node.names)} from dataclasses")
        if not isinstance(node, ast.ClassDef):
            continue
        if any(ast.unparse(d).split("(")[0].split(".")[-1] == "dataclass" for d in node.decorator_list):
            found.append(f"{path}:{node.name} is a dataclass")
        if any(ast.unparse(b).split(".")[-1] == "NamedTuple" for b in node.bases):
            found.append(f"{path}:{node.name} is a NamedTuple")
        for stmt in node.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
                if isinstance(stmt, ast.AnnAssign) else []
            if any(getattr(t, "id", "") == "__slots__" for t in targets) and path != "core/struct.py":
                found.append(f"{path}:{node.name} has hand-written __slots__")
    return found


def test_the_check_for_other_record_styles_can_fail():
    for source in ("from dataclasses import dataclass as dc\n", "import dataclasses\n@dataclasses.dataclass\nclass A: x: int\n",
                   "class A:\n    __slots__: tuple = ('x',)\n", "import typing\nclass A(typing.NamedTuple): x: int\n"):
        assert _record_styles_other_than_struct("tools/x.py", source), source
    assert not _record_styles_other_than_struct("tools/x.py", "import dataclasses\ndataclasses.fields(object)\n")


def test_the_package_defines_records_only_as_structs():
    """One style for one kind of record: no dataclass, NamedTuple or hand-written ``__slots__``
    record in the package (reading Megatron's own dataclasses stays allowed)."""
    root = REPO / "megatron_perf_toggles"
    offenders = [found for path in sorted(root.rglob("*.py"))
                 for found in _record_styles_other_than_struct(path.relative_to(root).as_posix(), path.read_text())]
    assert not offenders, offenders
