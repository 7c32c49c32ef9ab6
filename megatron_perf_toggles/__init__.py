"""Default-on Megatron-LM performance toggles with guards, precision-tagged log dirs and provenance.

Pass ``megatron_perf_toggles.extra_args_provider`` as Megatron's ``extra_args_provider`` (or use
``python -m megatron_perf_toggles.run``); ``chain_providers`` combines it with another provider.
"""

from __future__ import annotations

__all__ = [
    "PerfTogglesError",
    "RankMismatchError",
    "__version__",
    "chain_providers",
    "check_ranks",
    "extra_args_provider",
]

from typing import Any

from ._version import __version__
from .errors import PerfTogglesError
from .runtime.provider import chain_providers, extra_args_provider

# Records and messages name the provider as users write it (``megatron_perf_toggles:extra_args_provider``),
# not by the module that happens to define it.
extra_args_provider.__module__ = chain_providers.__module__ = __name__


def __getattr__(name: str) -> Any:
    # The rank check is for after process-group start; keep it off the import path until asked.
    if name in ("RankMismatchError", "check_ranks"):
        from .runtime import rank_check

        return getattr(rank_check, name)
    raise AttributeError(f"module 'megatron_perf_toggles' has no attribute {name!r}")
