"""A stand-in for Transformer Engine while a configuration front end is planned on a CPU machine.

Megatron-Bridge (and the Megatron code its recipes import) imports Transformer Engine at module
level, and TE needs a GPU build. Planning a recipe only builds configuration objects, so where TE
is not installed, cannot be imported (the empty ``transformer-engine`` meta package that a plain
``pip install transformer-engine`` leaves raises at import), or the plan is for another machine
whatever is installed here, any ``transformer_engine.*`` module is made on demand for the length
of the plan: lower-case names are submodules (also callable), capitalised ones placeholder classes. The
launcher's dry run stands in for triton the same way (``import_shims``). Nothing of it reaches the
decisions: the capabilities of a plan come from the planned stack (``capabilities.for_plan``), not
from this stand-in; its version is ``VERSION`` only so that import-time version checks pass.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import io
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from ..core.facts import version_tuple
from ..runtime.machine.probe import dist_version, import_failure, installed

VERSION = "2.8.0"
PACKAGE = "transformer_engine"
EXTENSION = "transformer_engine_torch"  # TE's compiled extension, a top-level module of its own


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # a submodule (te.common.recipe) or a function: both work as a module
            return importlib.import_module(f"{self.__name__}.{name}")
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``package`` and any of its submodules a placeholder module reporting ``version``."""

    def __init__(self, package: str, version: str) -> None:
        self.package, self.version = package, version

    def owns(self, fullname: str) -> bool:
        return fullname == self.package or fullname.startswith(self.package + ".")

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if self.owns(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = self.version  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextmanager
def stand_in(package: str, version: str, *, forget: bool = False, replace: bool = False) -> Iterator[bool]:
    """Within the block, ``import package...`` works where ``package`` is not installed (yields
    whether the stand-in is in place); with ``replace``, where it is installed too (the installed
    one, and any of its modules already imported, are out of sight for the block and back after
    it). Afterwards the finder is gone; with ``forget``, so is every stand-in module imported
    meanwhile (else modules that imported it keep their placeholders)."""
    if installed(package) and not replace:
        yield False
        return
    finder = _Finder(package, version)
    hidden = {n: m for n, m in sys.modules.items() if finder.owns(n)}
    for name in hidden:
        del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        if forget:
            for name in [n for n, m in sys.modules.items() if isinstance(m, _Module) and finder.owns(n)]:
                del sys.modules[name]
        sys.modules.update(hidden)


# The Megatron-Bridge releases that import NVIDIA ModelOpt at module level (0.6 no longer does).
MODELOPT_AT_IMPORT = ((0, 4), (0, 5))


def modelopt_first() -> None:
    """NVIDIA ModelOpt (which Megatron-Bridge 0.4 and 0.5 import at module level) registers Transformer
    Engine's layers as torch modules where TE imports, which the stand-in's placeholders are not (it
    fails there). Imported before the stand-in is placed, it finds no TE and registers none; nothing a
    plan reads comes of it. Only for those Bridge releases: ModelOpt's import is slow and brings the
    Hugging Face hub with it (which reads its offline setting once, when first imported). Where
    ModelOpt is not installed, or fails on its own, nothing happens."""
    if "modelopt" in sys.modules or not installed("modelopt") or _bridge_release() not in MODELOPT_AT_IMPORT:
        return
    with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
        importlib.import_module("modelopt.torch.quantization")


def _bridge_release() -> tuple[int, ...]:
    """The installed Megatron-Bridge's (major, minor), or () where it is not installed."""
    found = dist_version("megatron-bridge")
    return version_tuple(found)[:2] if found else ()


def loads(package: str = PACKAGE) -> bool:
    """Whether ``package`` is installed and imports here (``probe.import_failure``: the empty
    ``transformer-engine`` meta package raises at import, and so does a build for another CUDA)."""
    return installed(package) and import_failure(package) is None


@contextmanager
def transformer_engine(elsewhere: bool = False) -> Iterator[bool]:
    """Within the block, ``import transformer_engine...`` works (yields whether the stand-in is in
    place), and then so does TE's compiled ``transformer_engine_torch`` (which Megatron-Bridge 0.5
    imports at module level). The stand-in serves where TE is not installed, where it does not
    import (:func:`loads`), and, with ``elsewhere``, whatever is installed: a plan for another
    machine describes that machine's planned stack, never this one's TE. ModelOpt, where installed,
    is imported first (``modelopt_first``). Afterwards the finders are gone; modules imported
    meanwhile keep the placeholders they bound, which is all a plan that then ends needs."""
    replace = elsewhere or not loads(PACKAGE)
    if replace:
        modelopt_first()
    with stand_in(PACKAGE, VERSION, replace=replace) as placed, \
            (stand_in(EXTENSION, VERSION, replace=replace) if placed else nullcontext()):
        yield placed
