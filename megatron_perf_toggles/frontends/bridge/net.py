"""The safety net around Megatron-Bridge's configuration validation.

Bridge never runs Megatron's ``validate_args``: ``pretrain`` calls ``runtime_config_update``,
which ends in ``ConfigContainer.validate()`` (and builds Megatron's configs, whose own checks run
there). That is where a rule the guards do not know would reject a plugin default, so that is
what the net watches, by the argparse net's rules (``runtime.safety_net.smallest_backoff``): when
validation of a configuration :func:`~megatron_perf_toggles.bridge.apply` planned raises, it is
tried again, quietly and on copies, with plugin defaults set back to the configuration's own
values; the smallest set that lets it pass is backed off on the real configuration (source
``guard``, Bridge's message as the reason, a warning asking for a report), recorded through the
controller as an argparse back-off is, and validation runs again. Values anyone asked for are
never backed off, and where the configuration fails without the plugin's defaults too, Bridge's
own error surfaces unchanged.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from ...core.config_fields import bridge_homes
from ...runtime.context import RunContext, current
from ...runtime.safety_net import FOUND_AT_RUN_TIME, first_line, quiet_and_undone, smallest_backoff

NET_ATTR = "_perf_toggles_net"


def _set(cfg: Any, dest: str, value: Any) -> None:
    """Every Bridge field ``dest`` lives in, set to ``value``."""
    for home in bridge_homes().get(dest, ()):
        obj = cfg
        *parents, name = home.path.split(".")
        for part in parents:
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, home.to_field(value))


def _trial(original: Callable[[Any], Any], snapshot: Any, stock: dict[str, Any]) -> Callable[[list[str]], Any]:
    def trial(dests: list[str]) -> Any:
        cfg = copy.deepcopy(snapshot)
        for dest in dests:
            _set(cfg, dest, stock[dest])
        with quiet_and_undone():
            try:
                original(cfg)
            except Exception:  # noqa: BLE001 - a failed trial is an answer
                return None
        return cfg

    return trial


def _wrap(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def validate(cfg: Any) -> Any:
        ctx = current()  # the run context bridge.apply installed, for the configuration it planned
        front = ctx.front if ctx is not None else None
        if ctx is None or front is None or front.config is not cfg:
            return original(cfg)
        view, reg = front.view, front.registration
        snapshot = copy.deepcopy(cfg)
        try:
            return original(cfg)
        except Exception as error:
            records = getattr(view, "perf_toggles", None) or {}
            dests = smallest_backoff(_trial(original, snapshot, reg.stock), records, reg.stock)
            if not dests or ctx.controller is None or ctx.controller.last is None:
                raise
            reason = f"Bridge's validation rejected the plugin default, {FOUND_AT_RUN_TIME}: {first_line(error)}"
        for dest in dests:
            setattr(view, dest, reg.stock[dest])
            _set(snapshot, dest, reg.stock[dest])
        vars(cfg).update(vars(snapshot))  # the configuration as planned, with the back-off, validated again
        ctx.controller.on_backoff(ctx.controller.last)(view, dests, reason)
        return original(cfg)

    setattr(validate, NET_ATTR, original)
    return validate


def watch_validation(cfg: Any, ctx: RunContext) -> None:
    """Watch ``cfg``'s validation (``ctx.front``: the configuration bridge.apply planned; its class's
    ``validate`` is wrapped once, through the context's undo log, which puts Bridge's own back)."""
    cls = type(cfg)
    current_validate = getattr(cls, "validate", None)
    if current_validate is not None and not hasattr(current_validate, NET_ATTR):
        ctx.undo.set_attr(cls, "validate", _wrap(current_validate), "Megatron-Bridge ConfigContainer.validate (safety net)")
