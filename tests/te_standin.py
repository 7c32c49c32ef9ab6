"""A stand-in for Transformer Engine, for CPU tests of the config front ends only.

Megatron-Bridge imports Transformer Engine at module level, and TE needs a GPU build. The
front-end tests only build configurations, so any ``transformer_engine.*`` module is made on
demand: lower-case names are submodules (also callable), capitalised ones placeholder classes.
Its version is ``VERSION``, so the plugin's capability probe sees a TE with both kernels.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

VERSION = "2.8.0"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # a submodule (te.common.recipe) or a function: both work as a module
            import importlib

            return importlib.import_module(f"{self.__name__}.{name}")
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = VERSION
        return module

    def exec_module(self, module):
        pass


def install():
    sys.meta_path.insert(0, _Finder())
