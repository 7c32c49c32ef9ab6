"""``explain --bridge-recipe`` where Megatron-Bridge is not installed: plan from the recorded catalog.

The catalog (``runtime/bridge_catalog.py``, package data) holds what the Bridge adapter read from
each recipe of a recorded Bridge version, and the ``megatron-core`` that Bridge pins. The plan
goes through the same pipeline as with Bridge installed (``frontend.start`` + ``frontend.plan``),
for the planned world, GPU and stack, with Megatron's facts of that core from the recorded
surfaces; nothing of Bridge, torch or Transformer Engine is imported. A recipe's keyword
arguments change what it builds, which only Bridge itself can say: they need Bridge installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ..core.decide import Plan
from ..core.facts import Capabilities
from ..errors import PerfTogglesError
from ..runtime import bridge_catalog, frontend
from ..runtime import target as planned


def plan(ns: argparse.Namespace, target: planned.Target) -> tuple[Plan, Capabilities, str, dict[str, Any]]:
    """The plan of ``ns.bridge_recipe`` from the newest recorded catalog, as ``explain_frontends`` returns it."""
    if ns.megatron_args:
        raise PerfTogglesError("--bridge-recipe keyword arguments (KEY=VALUE after --) need Megatron-Bridge "
                               "installed: the recorded catalog holds each recipe as its defaults build it",
                               "install Megatron-Bridge, or plan the recipe without them")
    catalog = bridge_catalog.load()
    found = bridge_catalog.found(ns.bridge_recipe, catalog)
    env = frontend.read_env(os.environ)
    caps = dataclasses.replace(frontend.capabilities(env, target),
                               megatron=frontend.facts_for_version(catalog["megatron_core"]))
    with planned.stand_ins(target, megatron=False):
        ctx = frontend.start("bridge", mode="plan", caps=caps, target=target, announce=False)
        result, view, _ = frontend.plan(ctx, found)
    name = bridge_catalog.key(ns.bridge_recipe).rpartition(":")[2]
    label = (f"Megatron-Bridge {catalog['bridge']} as recorded (not installed here; megatron-core "
             f"{catalog['megatron_core']}), recipe {name}")
    return result, ctx.capabilities or caps, label, vars(view)
