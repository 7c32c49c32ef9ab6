"""Megatron-Bridge front end, under the name users import: ``from megatron_perf_toggles import bridge``.

The front end lives in ``frontends/bridge/`` (``public.py``, its adapter and recipe tracing beside
it); this module makes that one importable under the public name and holds nothing of its own.
"""

from __future__ import annotations

import sys

from .frontends.bridge import public as _module
from .frontends.bridge.public import (
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

# One module under both names: what users set on megatron_perf_toggles.bridge (a patched function,
# a replaced hook) is what the front end itself uses.
sys.modules[__name__] = _module
