"""The policy, pure: (parsed args, explicit flags, environment, capabilities) -> a Plan.

No Megatron, torch or environment access happens here, so every rule can be unit-tested in
milliseconds. Read top to bottom: base resolution (cli > env > profile > plugin default), then
the toggles that do not apply to this model (MoE ones on a dense model: Megatron's own value), the
FP4 layer selection, then the guards in order, then advice.

A profile value (``core.profile``) is treated by the guards exactly as an environment value: a
guard that cannot honour it changes it, with the reason and a warning that a requested value was
overridden; it is never refused as a command-line flag is. The profile is a request made ahead
of time for a setup like this one, not a flag typed for this run, so a machine that cannot honour
it should still train, and the warning names what the profile lost here.

The work is split by job: the records (``plan``), precedence and resolution (``resolve``), FP4
layer selection (``fp4``), and the guards (``guards``, declared in ``guards_grads`` and
``guards_model``). This module assembles the Plan and keeps the names other modules import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import stock_off
from ..env import EnvSettings
from ..facts import Capabilities
from ..precision import log_dir_warnings, precision_tag, tagged_log_dirs
from ..registry import BY_DEST, TOGGLES
from ..rules.guard_base import Guard, Need, guard, lacking
from ..rules.guards import GUARDS, NEEDS
from .fp4 import FP4_LAYER_DESTS, FP4_RECIPE_SELECTION, MEGATRON_FP4_LAYER_DEFAULTS, fp4_selection
from .plan import Change, Context, Decision, Message, Plan
from .resolve import Resolution, base_decision, requested

if TYPE_CHECKING:  # the profile module loads only when a profile is set (import time)
    from ..profile import Observed, Profile

__all__ = ["FP4_LAYER_DESTS", "FP4_RECIPE_SELECTION", "GUARDS", "MEGATRON_FP4_LAYER_DEFAULTS", "NEEDS", "Change",
           "Context", "Decision", "Guard", "Message", "Need", "Plan", "decide", "guard", "lacking",
           "requested"]

ADAM_EPS_ADVICE = (5e-4, 1e-6)  # (lr at or above, eps below)
NOT_MOE = "not a mixture-of-experts model (--num-experts is not set): stock's own value stands"


def _not_applicable(args: Mapping[str, Any], decisions: dict[str, Decision], stock: Mapping[str, Any]) -> tuple[str, ...]:
    """The toggles that mean nothing for this model (``Toggle.applies``): each keeps Megatron's own
    value (its default, or what the command line or the configuration set), whatever the
    environment, a profile or the plugin default asked, so no guard has anything to do with it."""
    out = tuple(t.dest for t in TOGGLES if not t.applies(args))
    for dest in out:
        if decisions[dest].source not in ("cli", "config"):
            decisions[dest] = Decision(stock.get(dest, BY_DEST[dest].stock_default), "default", NOT_MOE)
    return out


def _advice(args: Mapping[str, Any]) -> list[Message]:
    out: list[Message] = []
    lr, eps = args.get("lr"), args.get("adam_eps")
    min_lr, max_eps = ADAM_EPS_ADVICE
    if (
        str(args.get("optimizer") or "adam").startswith("adam")
        and isinstance(lr, (int, float)) and isinstance(eps, (int, float))
        and lr >= min_lr and eps < max_eps
    ):
        out.append(Message(
            "advice",
            f"--adam-eps {eps:g} with --lr {lr:g}: a small epsilon at a high learning rate can "
            "plateau (grad norm climbing); the MLPerf Llama-3.1-8B recipe uses --adam-eps 1e-5 "
            "at lr 8e-4. Nothing was changed.",
        ))
    if args.get("yaml_cfg"):
        out.append(Message(
            "warning",
            "--yaml-cfg replaces the whole parsed namespace after this step: the toggles decided "
            "here (and any provider-added argument) do not carry over; set them in the YAML file.",
        ))
    return out


def decide(
    args: Mapping[str, Any],
    explicit: Mapping[str, Any],
    env: EnvSettings,
    caps: Capabilities,
    stock: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    profile: Profile | None = None,
    observed: Observed | None = None,
    preset: Mapping[str, Decision] | None = None,
    stock_from: Mapping[str, str] | None = None,
) -> Plan:
    """Resolve every toggle, then let the guards veto what cannot be honoured.

    ``args`` is the parsed namespace (non-explicit toggles at any value), ``explicit`` the dests
    the command line set, ``stock`` Megatron's own defaults (used when the plugin is disabled),
    ``checkpoint`` what the launch that wrote the checkpoint being resumed recorded (resume.py).
    ``profile`` the parsed MEGATRON_PERF_TOGGLES_PROFILE, compared with ``observed`` (this run's
    environment, as far as it is known now). ``preset`` holds the decisions (source ``config``)
    for values a configuration object already carries, where a front end without a command line
    (Megatron-Bridge, Primus) found them set: below the environment, above the profile and the
    defaults; a guard changes one with a warning, as it does an environment value. ``stock_from``
    says where a front end's stock values come from (dest -> words, e.g. Primus's YAML default):
    with the plugin off they are labelled so. Raises CannotHonourError for an explicit command-line
    request that a guard rejects.
    """
    stock = stock or {}
    decisions = {t.dest: base_decision(t.dest, explicit, env, stock, profile, preset, stock_from) for t in TOGGLES}
    not_applicable = _not_applicable(args, decisions, stock)
    fp4_decisions, messages = fp4_selection(args, explicit, env, stock, preset, stock_from)
    decisions.update(fp4_decisions)
    resolution = Resolution(decisions, env, caps)
    resolution.messages = messages
    for each in GUARDS:
        ctx = resolution.context(args, checkpoint)
        for change in each(ctx):
            resolution.apply(ctx, change)
    messages.extend(resolution.overridden.values())
    # --- memory: price each decision, back off defaults that would tip a fitting job (core/memory/memory_guard.py)
    from ..memory.memory_guard import guard_memory

    memory, memory_messages = guard_memory(args, decisions, caps, env, stock)
    messages.extend(memory_messages)
    profile_record = None
    if profile is not None:
        from ..profile import profile_in_use

        profile_record, line = profile_in_use(profile, observed)
        if line:
            messages.append(Message("profile", line))
    messages.extend(_advice(args))
    tag = precision_tag(args)
    tagging = stock_off.tags_log_dirs(env)  # switched off, the log directories stay as given
    log_dirs = tagged_log_dirs(args, tag) if tagging else {}
    if tagging:
        messages.extend(Message("warning", text) for text in log_dir_warnings(args, tag))
    wgrad_path = stock_off.wgrad_path(bool(decisions["gradient_accumulation_fusion"].value), caps, env)
    messages.extend(stock_off.notes(wgrad_path, env))
    return Plan(decisions=decisions, precision=tag, log_dirs=log_dirs, messages=messages, wgrad_path=wgrad_path,
                profile=profile_record, memory=memory.to_record(), not_applicable=not_applicable)
