"""The launcher front end: ``python -m megatron_perf_toggles.run SCRIPT ...``, Megatron's parser
reached without editing Megatron or naming a provider.

It is the argparse front end (``megatron_parser.py``) put into Megatron's parse path by the
launcher (``launcher/launch.py``: the parse hooks for the version at hand, then SCRIPT run as
``__main__``), with the dry run (``launcher/dry_run.py``) as its way to plan without training.
This module names it beside the other front ends and is what ``run.py`` runs.
"""

from __future__ import annotations

from ..launcher.launch import PROG, main

__all__ = ["PROG", "main"]
