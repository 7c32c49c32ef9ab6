"""Make a Megatron-LM checkout importable for argument parsing on machines without a GPU stack.

Megatron 0.16+ imports ``triton`` at module level in places that argument parsing pulls in, and
0.18.2+ uses ``typing.override`` (Python 3.12+). Neither matters for parsing, so on machines that
lack them Megatron's own modules get a stand-in. The stand-in never enters ``sys.modules``:
torch's optional-triton probes must keep seeing "not installed".

A process that ends in its plan (the launcher's dry run, a patched checkout's) also leaves
Megatron's ``torch.compile`` decorators uncompiled: nothing compiled runs in a plan, and the first
decorator would import TorchDynamo (about 2.5 s). Modules imported that way keep their functions
uncompiled, so a process that may train afterwards (``explain`` as a library call) never gets it.

Each stand-in is put in place by whichever caller comes first and undone by that caller alone: a
nested caller (a patched checkout's dry run inside the launcher's block) finds it there and leaves it.
"""

from __future__ import annotations

import builtins
import functools
import importlib.abc
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..runtime.machine.probe import import_failure as does_not_import
from ..runtime.machine.probe import installed
from ..runtime.process_changes import PROCESS_CHANGES, ProcessChanges

STAND_IN_PACKAGES = ("triton",)
# Imported by Megatron where installed, taken as absent where it does not import (a plan for another
# machine): Transformer Engine, and its compiled extension.
ABSENT_IF_BROKEN = ("transformer_engine", "transformer_engine_torch")
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


class _Anything:
    """A value that tolerates whatever module-level Megatron code does with a triton symbol."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Anything:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        # Decorator use (@triton.jit, @triton.autotune(...)(fn)) must hand the function back.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything(f"{self._name}()")

    def __getitem__(self, item: object) -> _Anything:
        return self

    def __iter__(self) -> Iterator[object]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    __version__ = "0.0.0+stand-in"

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self.__name__}.{attr}")


def _override(fn: Callable[..., object]) -> Callable[..., object]:
    """``typing.override`` as Python 3.12 has it, for Megatron 0.18.2+ on older Pythons."""
    return fn


def _remove_path(entry: str) -> None:
    if entry in sys.path:
        sys.path.remove(entry)


def _is_megatron_module(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def _stand_in_imports(changes: ProcessChanges) -> None:
    if any(not installed(name) for name in STAND_IN_PACKAGES) and not getattr(
            builtins.__import__, "_perf_toggles_stand_in", False):
        changes.set_attr(builtins, "__import__", _stand_in_import(builtins.__import__), "stand-in imports")


def _stand_in_import(real_import: Callable[..., types.ModuleType]) -> Callable[..., types.ModuleType]:
    def importer(name: str, globals: Mapping[str, Any] | None = None, locals: Mapping[str, Any] | None = None,
                 fromlist: Sequence[str] = (), level: int = 0) -> types.ModuleType:
        if (
            level == 0
            and name.partition(".")[0] in STAND_IN_PACKAGES
            and _is_megatron_module((globals or {}).get("__name__", ""))
        ):
            # "import a.b" binds the top package; "from a.b import c" reads c off a.b.
            return _StandInModule(name if fromlist else name.partition(".")[0])
        return real_import(name, globals, locals, fromlist, level)

    importer._perf_toggles_stand_in = True  # type: ignore[attr-defined]
    return importer


class _Absent(importlib.abc.MetaPathFinder):
    """Answers an import of ``packages`` (and their modules) as of a package that is not installed."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = tuple(packages)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.packages:
            raise ModuleNotFoundError(f"No module named {fullname!r} (it does not import here: a plan for another "
                                      "machine takes it as absent)", name=fullname)
        return None


def _broken_as_absent(changes: ProcessChanges) -> None:
    """A plan for another machine does not rest on this machine's Transformer Engine: where the one
    installed here does not import (the empty ``transformer-engine`` meta package raises "Found
    empty `transformer-engine` meta package installed"), Megatron sees none, as on a machine
    without it, instead of stopping at its import."""
    broken = [name for name in ABSENT_IF_BROKEN if does_not_import(name) is not None]
    if broken and not any(isinstance(f, _Absent) for f in sys.meta_path):
        finder = _Absent(broken)
        changes.install(f"{', '.join(broken)} taken as absent (it does not import)",
                        lambda: sys.meta_path.insert(0, finder), lambda: sys.meta_path.remove(finder))


def _as_is(fn: Any = None, *args: Any, **options: Any) -> Any:
    """``torch.compile`` and ``torch.compiler.disable`` while planning: the function as it is,
    used bare (``@torch.compile``) or with options (``@torch.compile(mode=...)``)."""
    return fn if fn is not None else (lambda wrapped: wrapped)


def _no_compiling(changes: ProcessChanges) -> None:
    """Megatron's modules, imported for a plan that ends the process, keep their functions as
    written (see above). torch is imported here, where it is installed: Megatron imports it first
    thing anyway."""
    if "torch" not in sys.modules and not installed("torch"):
        return
    try:
        import torch
    except Exception:  # noqa: BLE001 - Megatron's own import will report a torch that does not import
        return
    if getattr(torch, "compile", _as_is) is not _as_is:  # a torch before 2.0 has none
        changes.set_attr(torch, "compile", _as_is, "torch.compile -> the function as is (planning)")
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "disable", _as_is) is not _as_is:
        changes.set_attr(compiler, "disable", _as_is, "torch.compiler.disable -> the function as is (planning)")


@contextmanager
def megatron_importable(tree: str | os.PathLike[str] | None = None, stand_ins: bool = True,
                        uncompiled: bool = False, elsewhere: bool = False) -> Iterator[None]:
    """Within this block, ``import megatron.training.arguments`` works from ``tree`` on a CPU box.

    ``stand_ins=False`` keeps only the harmless ``typing.override`` shim: a real training run must
    see a missing triton as missing, not get a stand-in whose kernels would fail later.
    ``uncompiled=True``, for a process that ends in this plan only: Megatron's ``torch.compile``
    decorators leave their functions as they are (see the module's docstring).
    ``elsewhere=True``, for a plan for another machine: a Transformer Engine installed here that does
    not import is taken as absent (``_broken_as_absent``).
    """
    if tree is not None:
        entry = str(Path(tree).resolve())
        sys.path.insert(0, entry)
        PROCESS_CHANGES.on_uninstall(f"sys.path entry {entry}", functools.partial(_remove_path, entry))
    if not hasattr(typing, "override"):
        PROCESS_CHANGES.set_attr(typing, "override", _override, "typing.override (Python < 3.12)")
    scoped = ProcessChanges()  # the stand-ins last only as long as the block, however it ends
    if stand_ins:
        _stand_in_imports(scoped)
    if uncompiled:
        _no_compiling(scoped)
    if elsewhere:
        _broken_as_absent(scoped)
    try:
        yield
    finally:
        scoped.uninstall()


def install_stand_ins(elsewhere: bool = False) -> None:
    """For a patched checkout's dry run: the stand-ins ``megatron_importable`` gives the launcher,
    for the rest of the process (which ends in the dry run), undone by ``PROCESS_CHANGES.uninstall()``."""
    if not hasattr(typing, "override"):
        PROCESS_CHANGES.set_attr(typing, "override", _override, "typing.override (Python < 3.12)")
    _stand_in_imports(PROCESS_CHANGES)
    _no_compiling(PROCESS_CHANGES)
    if elsewhere:
        _broken_as_absent(PROCESS_CHANGES)


def _gpu_build_without_gpu() -> bool:
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if torch is None or not (getattr(version, "cuda", None) or getattr(version, "hip", None)):
        return False
    try:
        return not torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a torch that cannot even ask has no usable GPU
        return True


def import_failure(error: BaseException) -> tuple[str, str | None]:
    """(what broke, and in which of Megatron's files; a hint) for an import of Megatron that raised.

    Some trees build GPU extensions while being imported (core 0.15's inference/unified_memory.py
    compiles a CUDA allocator): with a CUDA or ROCm build of torch and no GPU that raises. Planning
    needs no GPU code at all, so the hint is PyTorch's CPU build."""
    frames = traceback.extract_tb(error.__traceback__)
    site = next((f for f in reversed(frames) if f"{os.sep}megatron{os.sep}" in f.filename), None)
    where = ""
    if site is not None:
        where = f" (in megatron{os.sep}{site.filename.rsplit(os.sep + 'megatron' + os.sep, 1)[1]}:{site.lineno})"
    text = " ".join(str(error).split()) or "no message"
    what = f"{type(error).__name__}: {text}{where}"
    if _gpu_build_without_gpu():
        return what, ("this torch is a GPU build and no GPU is visible, and this Megatron runs GPU code at import; "
                      f"to plan on this machine use PyTorch's CPU build: {CPU_TORCH}")
    return what, "install Megatron-LM's requirements (see the README: 'Plan your job')"
