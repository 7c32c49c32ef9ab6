"""Asking whether an optional package is here, without importing what need not be.

One place for "is it installed" and for "the torch this process has, or imports now": capability
detection, the planned machine of a dry run, the wgrad fallback and the launcher's import stand-ins
all ask the same questions.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any


def installed(module: str) -> bool:
    """Whether ``module`` can be found (its spec; nothing is imported but a parent package)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def torch_module(import_it: bool = True) -> Any | None:
    """The torch this process has imported, else (with ``import_it``) torch imported now; None where
    it is not installed or does not import."""
    torch = sys.modules.get("torch")
    if torch is not None or not import_it or not installed("torch"):
        return torch
    try:
        return importlib.import_module("torch")
    except Exception:  # noqa: BLE001 - a torch that does not import is as good as none here
        return None
