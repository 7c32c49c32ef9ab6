"""core/struct.py: the package's one record type behaves as the dataclass it replaces, and the
package defines no record any other way."""

from __future__ import annotations

import ast
import copy
import pickle

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


class Loose(Struct):
    a: int = 0


class Tight(Loose, frozen=True):
    b: int = 0


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
    with pytest.raises(FrozenStructError):
        Tight().a = 1  # a frozen child of a mutable parent is frozen
    loose = Loose()
    loose.a = 1
    assert hash(Tight(1, 2)) == hash(Tight(1, 2))


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


def test_declaration_errors_are_raised_when_the_class_is_defined():
    with pytest.raises(TypeError, match="mutable default"):
        class Shared(Struct):
            items: list = []  # noqa: RUF012
    with pytest.raises(TypeError, match="without a default follows"):
        class Order(Struct):
            a: int = 0
            b: int


def test_the_package_defines_records_only_as_structs():
    """One style for one kind of record: no ``@dataclass`` and no hand-written ``__slots__``
    record in the package (reading Megatron's own dataclasses stays allowed)."""
    offenders = []
    for path in sorted((REPO / "megatron_perf_toggles").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if any(d.split("(")[0] in ("dataclass", "dataclasses.dataclass") for d in decorators):
                    offenders.append(f"{path.name}:{node.name} is a dataclass")
                if path.name != "struct.py" and any(
                        isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in s.targets)
                        for s in node.body):
                    offenders.append(f"{path.name}:{node.name} has hand-written __slots__")
    assert not offenders, offenders
