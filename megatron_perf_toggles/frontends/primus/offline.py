"""Plan a Primus experiment file where Megatron-LM is not installed: a recorded Megatron surface
stands in for ``megatron.training.arguments``, and torch for Primus's imports.

Primus builds Megatron's namespace with Megatron's own argument definitions; without Megatron-LM,
the recorded surface (``DEFAULT_SURFACE``, the newest) gives them, and the plan takes that
surface's Megatron facts. Primus's Megatron backend also imports torch at module level in its
patch modules, though building the namespace from YAML runs none of it: on a laptop without torch
(``pip install 'megatron-perf-toggles[primus]'``) any ``torch.*`` module is made on demand for the
length of the build, with the placeholders of Transformer Engine's stand-in (``te_standin``), and
taken out of ``sys.modules`` again when the block ends, so that nothing after it (the plugin's own
probes included) takes it for an installed torch. Nothing of it reaches the decisions: a plan's
capabilities come from the planned stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ...core.facts import Capabilities, megatron_facts_from_surface
from ...runtime import surface_replay as replay
from ...runtime.machine import target as planned
from ...runtime.process_changes import ProcessChanges
from ...runtime.surface_replay import DEFAULT_SURFACE
from .. import adapter as frontend
from ..te_standin import stand_in

PACKAGE = "torch"
VERSION = "0.0.0+planning-stand-in"


def torch_if_missing() -> AbstractContextManager[bool]:
    """Within the block, ``import torch...`` works where torch is not installed (yields whether the
    stand-in is in place); afterwards neither the finder nor any stand-in module is left."""
    return stand_in(PACKAGE, VERSION, forget=True)


def _arguments_module(surface: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType("megatron.training.arguments", f"Megatron's arguments, recorded ({surface['name']})")

    def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        recorded = replay.parser_from_surface(surface)
        for action in recorded._actions:
            if not isinstance(action, argparse._HelpAction):
                parser._add_action(action)
        return parser

    module.add_megatron_arguments = add_megatron_arguments  # type: ignore[attr-defined]
    module.__file__ = None
    return module


@contextmanager
def recorded_megatron(name: str = DEFAULT_SURFACE) -> Iterator[dict[str, Any]]:
    """Within this block ``megatron.training.arguments`` is the recorded surface ``name``'s stand-in."""
    surface = replay.load_surface(name)
    stand = ProcessChanges()
    package = types.ModuleType("megatron", "stand-in: a recorded Megatron surface")
    training = types.ModuleType("megatron.training", "stand-in: a recorded Megatron surface")
    package.__path__ = []
    training.__path__ = []
    arguments = _arguments_module(surface)
    training.arguments = arguments  # type: ignore[attr-defined]
    package.training = training  # type: ignore[attr-defined]
    try:
        for module in (package, training, arguments):
            stand.set_item(sys.modules, module.__name__, module, f"stand-in {module.__name__}")
        with torch_if_missing():  # Primus's patch modules import torch, which building the namespace never runs
            yield surface
    finally:
        stand.uninstall()


def capabilities(surface: dict[str, Any], target: planned.Target) -> Capabilities:
    """The planned machine's capabilities with the recorded surface's Megatron facts."""
    caps = frontend.capabilities(frontend.read_env(os.environ), target)
    return dataclasses.replace(caps, megatron=megatron_facts_from_surface(surface))
