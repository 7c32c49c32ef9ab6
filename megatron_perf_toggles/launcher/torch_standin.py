"""A stand-in for torch while a Primus experiment file is planned on a machine without it.

Primus's Megatron backend imports torch at module level in its patch modules, though building
Megatron's namespace from YAML runs none of it. On a laptop without torch (``pip install
'megatron-perf-toggles[primus]'``), any ``torch.*`` module is made on demand for the length of the
build, with the same placeholders as Transformer Engine's stand-in (``te_standin``). When the block
ends the finder is gone and every stand-in module is taken out of ``sys.modules`` again, so that
nothing after it (the plugin's own probes included) takes it for an installed torch. Nothing of it
reaches the decisions: a plan's capabilities come from the planned stack.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..runtime.probe import installed
from .te_standin import _Module

PACKAGE = "torch"
VERSION = "0.0.0+planning-stand-in"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == PACKAGE or fullname.startswith(PACKAGE + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextmanager
def torch_if_missing() -> Iterator[bool]:
    """Within the block, ``import torch...`` works where torch is not installed (yields whether the
    stand-in is in place); afterwards neither the finder nor any stand-in module is left."""
    if installed(PACKAGE):
        yield False
        return
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _Module) and
                     (n == PACKAGE or n.startswith(PACKAGE + "."))]:
            del sys.modules[name]
