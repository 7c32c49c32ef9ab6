"""Megatron-Bridge front end, under the name users import: ``from megatron_perf_toggles import bridge``.

The front end lives in ``frontends/`` (``frontends/bridge.py``, its adapter and recipe tracing beside
it); this module keeps the public import path working and holds nothing of its own.
"""

from __future__ import annotations

from .frontends.bridge import (
    apply,
    build,
    declared_default,
    explain,
    generic_declaration,
    read,
    traced_fields,
    write,
)

__all__ = ["apply", "build", "declared_default", "explain", "generic_declaration", "read", "traced_fields", "write"]
