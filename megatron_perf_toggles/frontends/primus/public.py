"""Primus front end: the plugin's decisions on the Megatron namespace Primus builds from YAML.

Primus replaces Megatron's ``parse_args`` (with no ``extra_args_provider``), so the plugin's
argparse hooks never see its runs. It offers its own extension point instead: patches registered
with ``primus.core.patches.register_patch(backend="megatron", phase="build_args")`` run on the
namespace after Primus built it and before the trainer (and Megatron's ``validate_args``) sees it.
:func:`register` adds one such patch; importing this module registers it when Primus is there::

    import megatron_perf_toggles.primus  # e.g. from a .pth file: see docs/primus.md

Two patches: ``build_args`` plans through the one pipeline (``frontends/primus/adapter.py``, the
adapter; ``frontends/adapter.py``, the pipeline), and ``before_train``, after Primus wrapped
Megatron's ``validate_args``, makes a refusal stop the job there and lets the safety net watch
the validation (``frontends/primus/validate.py``).
"""

from __future__ import annotations

from typing import Any

from ...errors import PerfTogglesError
from ...runtime.context import FrontEnd
from ...runtime.controller import new_context
from .adapter import PATCH_ID, apply_to_namespace, explain, megatron_default, primus_defaults, read

VALIDATE_ID = "megatron_perf_toggles.validate_args"
__all__ = ["PATCH_ID", "VALIDATE_ID", "apply_to_namespace", "build_args_patch", "explain", "megatron_default",
           "primus_defaults", "read", "register"]

def build_args_patch(ctx: Any) -> None:
    """Primus's ``build_args`` phase: the namespace is ``ctx.extra["backend_args"]``. A refusal is
    kept for the namespace, not raised here: Primus logs and swallows what a patch raises, so it
    stops the job where Primus's own checks do (:func:`before_train_patch`)."""
    ns = ctx.extra.get("backend_args")
    if ns is None:
        return
    try:
        apply_to_namespace(ns)
    except PerfTogglesError as error:  # its one line comes with the stop, from the process's context
        new_context("primus", controller=False).install().front = FrontEnd(ns, refusal=error)


def before_train_patch(ctx: Any) -> None:
    """Primus's ``before_train`` phase, after its own ``megatron.validate_args`` patch: Megatron's
    ``validate_args`` (as Primus wrapped it) raises a refusal kept at ``build_args``, with one line
    and exit status 2 on every rank, and otherwise runs inside the safety net."""
    from . import validate as primus_validate

    primus_validate.install(ctx.extra.get("backend_args"))


def register() -> bool:
    """Register the patches with Primus (its registry replaces a patch registered again under the
    same id); False where Primus is not importable. ``build_args`` at priority 90: after Primus's
    own argument patches (lower numbers run first), so the plugin decides on their result;
    ``before_train`` at 90: after Primus wrapped ``validate_args``."""
    try:
        from primus.core.patches import register_patch
    except ImportError:
        return False
    register_patch(PATCH_ID, backend="megatron", phase="build_args", priority=90,
                   description="megatron-perf-toggles: the plugin's toggle decisions")(build_args_patch)
    register_patch(VALIDATE_ID, backend="megatron", phase="before_train", priority=90,
                   description="megatron-perf-toggles: refusals and the safety net at validate_args")(before_train_patch)
    return True


register()
