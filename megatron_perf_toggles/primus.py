"""Primus front end, under the name users import: ``import megatron_perf_toggles.primus`` registers
the plugin's patches with Primus (see docs/primus.md).

The front end lives in ``frontends/primus/`` (``public.py``, its adapter and validation beside
it); importing this module imports that one, which registers the patches, and makes it this name too.
"""

from __future__ import annotations

import sys

from .frontends.primus import public as _module
from .frontends.primus.public import (
    PATCH_ID,
    VALIDATE_ID,
    apply_to_namespace,
    before_train_patch,
    build_args_patch,
    explain,
    megatron_default,
    primus_defaults,
    read,
    register,
)

__all__ = ["PATCH_ID", "VALIDATE_ID", "apply_to_namespace", "before_train_patch", "build_args_patch", "explain",
           "megatron_default", "primus_defaults", "read", "register"]

# One module under both names: what users set on megatron_perf_toggles.primus (a patched function,
# a replaced hook) is what the front end itself uses.
sys.modules[__name__] = _module
