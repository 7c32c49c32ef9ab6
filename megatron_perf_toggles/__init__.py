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


def __getattr__(name: str) -> Any:
    # The provider loads the decision core: only when asked, so that importing a submodule (the
    # Primus .pth hook runs in every interpreter of an environment) does not load it.
    if name in ("chain_providers", "extra_args_provider"):
        from .runtime import provider

        return getattr(provider, name)
    # The rank check is for after process-group start; keep it off the import path until asked.
    if name in ("RankMismatchError", "check_ranks"):
        from .runtime import rank_check

        return getattr(rank_check, name)
    raise AttributeError(f"module 'megatron_perf_toggles' has no attribute {name!r}")
