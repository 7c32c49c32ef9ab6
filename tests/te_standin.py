"""A stand-in for Transformer Engine, for CPU tests of the config front ends only.

Megatron-Bridge imports Transformer Engine at module level, and TE needs a GPU build. The
front-end tests only build configurations, so they use the package's own stand-in
(``megatron_perf_toggles.frontends.te_standin``: any ``transformer_engine.*`` module made on demand),
put in place here for the rest of the driver's process rather than for one plan.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

from megatron_perf_toggles.frontends.te_standin import VERSION, transformer_engine

__all__ = ["VERSION", "install"]
_HELD: list[AbstractContextManager[bool]] = []  # the stand-in stays in place until the process ends


def install() -> None:
    standin = transformer_engine()
    standin.__enter__()
    _HELD.append(standin)
