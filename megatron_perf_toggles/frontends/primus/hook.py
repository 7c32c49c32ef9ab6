"""Turn the Primus front end on from a ``.pth`` file without importing Primus at every start.

A ``.pth`` line runs in every interpreter of the environment, most of which never train. This
module only installs an import hook: when (and if) ``primus.core.patches`` is imported, the
plugin's ``build_args`` patch is registered with it (``megatron_perf_toggles.primus.register``).
Nothing else is imported until then. The ``.pth`` line is::

    import megatron_perf_toggles.primus_hook
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "primus.core.patches"


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then registers the plugin's patch."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        """Everything else (is_package, get_data, get_resource_reader...) is the real loader's, so
        the wrapped module behaves as it would without the hook."""
        return getattr(self.real, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        _register()


def _register() -> None:
    """Importing the front end registers its patch; an already imported one registers again."""
    name = f"{__package__}.public"
    if name in sys.modules:
        sys.modules[name].register()
    else:
        importlib.import_module(name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if Primus's patches are already imported, else when they are."""
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
