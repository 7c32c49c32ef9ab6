"""``explain --primus-config`` where no Megatron-LM is at hand: Megatron's parser from a recorded surface.

Primus builds Megatron's namespace from Megatron-LM's own argument definitions
(``megatron.training.arguments.add_megatron_arguments``), which import torch and the whole of
Megatron. A laptop with a Primus checkout whose Megatron submodule was not fetched has neither.
The definitions are what the recorded surfaces hold, so for the length of the plan
``megatron.training.arguments`` is a stand-in whose ``add_megatron_arguments`` adds the recorded
surface's flags (names, defaults, types, choices) to Primus's parser, and Megatron's facts come
from the same surface. Nothing else of Megatron is stood in for: Primus code that needs more says
so in one line, as any file that cannot be built does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..core.facts import Capabilities, megatron_facts_from_surface
from ..launcher.torch_standin import torch_if_missing
from ..runtime import frontend
from ..runtime import target as planned
from ..runtime.process_changes import ProcessChanges
from .planning import DEFAULT_SURFACE
from .surfaces import replay


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
