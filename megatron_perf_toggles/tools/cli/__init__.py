"""``megatron-perf-toggles``: explain, flags, doctor, patch, ablate, tune, surface.

One module per command (``explain``, ``flags``, ``doctor``), what explain and flags plan against
(``options``), what explain and doctor print with (``output``), and the parser and ``main``
(``command``). This package keeps the names callers use: ``main`` (the console script and
``python -m megatron_perf_toggles``), and ``plan_command_line`` and the table for tests.
"""

from ..planning import plan_command_line
from .command import build_cli_parser, main
from .output import UNDER_INDENT, _table

__all__ = ["UNDER_INDENT", "_table", "build_cli_parser", "main", "plan_command_line"]
