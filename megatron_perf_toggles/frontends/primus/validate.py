"""Primus's ``before_train`` phase: where a refusal stops the job, and the safety net watches.

Primus runs ``build_args`` patches with their errors logged and swallowed, so a refusal raised
there would be printed and the job would train on. Primus's own checks stop a job from
Megatron's ``validate_args``, which its ``megatron.validate_args`` patch wraps (ROCm checks after
Megatron's) in this same phase. This patch runs after that one, on the same namespace:

- a refusal kept at ``build_args`` replaces ``validate_args`` wherever Megatron bound it: the
  first call prints the one ``[perf-toggles] error:`` line and ends the process with exit status
  2, on every rank. It ends the process itself (output flushed, as Primus's ``PRIMUS_EXIT_FAST``
  does) because Primus turns any exception from training, ``SystemExit`` included, into a
  ``RuntimeError`` with a traceback and exit status 1;
- otherwise Megatron's (Primus-wrapped) ``validate_args`` runs inside the argparse path's safety
  net (``runtime.safety_net``), watching this namespace with the controller that planned it.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from ...errors import PREFIX, PerfTogglesError
from ...runtime.context import current
from ...runtime.process_changes import PROCESS_CHANGES
from ...runtime.rebinding import ORIGINAL_ATTR, megatron_root, rebind


def _end(error: PerfTogglesError) -> None:
    """The one line, on the process's own stderr (Primus's logger decorates ``sys.stderr``), then
    the end of the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, f"{PREFIX} error: {error}\n".encode())
    os._exit(error.exit_code)


def _refusing(original: Callable[..., Any], ns: Any, error: PerfTogglesError,
              end: Callable[[PerfTogglesError], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(*args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get("args")
        if given is ns or given is None:
            end(error)
        return original(*args, **kwargs)

    setattr(validate_args, ORIGINAL_ATTR, original)
    return validate_args


def install(ns: Any, end: Callable[[PerfTogglesError], None] = _end) -> str:
    """Arm ``validate_args`` for ``ns``, from the process's run context (the ``build_args`` patch
    installed it): ``"refusal"``, ``"net"`` or ``"none"`` (a namespace the plugin did not plan).
    ``end`` is what a refusal does (the process ends; tests pass another)."""
    ctx = current()
    front = ctx.front if ctx is not None else None
    if ns is None or front is None or front.config is not ns:
        return "none"
    import megatron.training.arguments as arguments

    if isinstance(front.refusal, PerfTogglesError):
        current_validate = arguments.validate_args
        wrapper = _refusing(current_validate, ns, front.refusal, end)
        root = megatron_root(arguments)
        rebind(current_validate, wrapper, root)
        PROCESS_CHANGES.on_uninstall("the plugin's refusal at validate_args (Primus)",
                             functools.partial(rebind, wrapper, current_validate, root))
        return "refusal"
    if ctx is None or ctx.controller is None or front.registration is None:
        return "none"
    from ...runtime.safety_net import NET

    NET.install(arguments)
    ctx.controller.watch(ns, front.registration)
    return "net"
