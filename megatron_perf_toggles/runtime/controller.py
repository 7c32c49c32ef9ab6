"""One owner of the toggles in a process: environment, capabilities, plan, and applying the plan.

The argparse adapter (``provider``) hands every parse here. :meth:`Controller.plan` decides and
writes the decisions onto the parsed namespace, and changes nothing else in the process; it is all
that ``explain`` and the dry run need. :meth:`Controller.apply` does what a real run needs on top:
the wgrad fallback, the cross-rank check, the start-up table and the provenance record. Every
process-wide change made there goes through ``process_changes.PROCESS_CHANGES``, which can undo it; the
controller belongs to a run context (``context.py``), which holds it for the process.

What a controller is for is said once, by its ``mode``:

- ``run``: a training run on this machine. Plans, then applies.
- ``dry-run``: the launcher's dry run on this machine. Plans (capabilities detected here, the
  resumed checkpoint compared) and lets the safety net watch Megatron's validation; applies nothing.
- ``plan``: planning for another machine (``explain`` on a recorded surface): the capabilities
  are given, nothing of this machine is consulted and nothing is applied.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.ckpt_layout import checkpoint_facts
from ..core.decision.decide import Decision, Message, Plan, decide
from ..core.env import EnvSettings, read_env
from ..core.facts import Capabilities
from ..errors import PerfTogglesError
from . import provenance, resume
from .context import MODES, Mode, RunContext, current
from .machine.capabilities import for_plan
from .machine.target import planned_world

if TYPE_CHECKING:  # loaded only when a profile is set: the import path stays short
    from ..core.profile import Profile
    from .machine.target import Target


class _Unset:
    def __repr__(self) -> str:
        return "<decided after parsing>"


UNSET: Any = _Unset()  # the default of every watched dest: "the command line did not say"


@dataclass(slots=True)
class Registration:
    """What an adapter learned from its configuration: enough to plan each of its parses.

    The argparse adapter fills the first four (the command line's values are told from defaults by
    ``UNSET``); a configuration front end (Megatron-Bridge, Primus) has no command line and says
    directly what was asked (``explicit``: held as a flag is) and what its configuration set
    (``preset``: the ``config`` tier), and rewrites reasons into its own words (``speak``)."""

    controller: Controller
    stock: dict[str, Any]  # Megatron's own defaults of the watched dests (a front end's: its own values)
    watched: tuple[str, ...]  # the dests whose command-line value we must tell from a default
    added_flags: list[str] = field(default_factory=list)  # the flag forms this parser lacked
    explicit: dict[str, Any] = field(default_factory=dict)  # dest -> value named explicitly (a front end's)
    preset: dict[str, Decision] = field(default_factory=dict)  # dest -> the configuration's own value
    # dest -> where a stock value comes from, where not Megatron's own default (a front end's, in words)
    stock_from: dict[str, str] = field(default_factory=dict)
    speak: Callable[[str], str] | None = None  # Megatron's words (flags) into the front end's (fields, keys)


@dataclass(slots=True)
class Outcome:
    """One parse's plan, what it rests on, and what it changed on the namespace."""

    plan: Plan
    capabilities: Capabilities
    writer: dict[str, Any] | None  # the launch that wrote the checkpoint being resumed, if known
    original_dirs: dict[str, str]  # log directories as given, before the precision tag


def process_controller() -> Controller | None:
    """The controller of the installed run context, if any: a provider that calls
    ``extra_args_provider`` itself (the ROCm fork's combined provider) joins it."""
    ctx = current()
    return None if ctx is None else ctx.controller


class Controller:
    """The plugin's state in one process: what the environment asked, what was decided, whether
    the decisions were announced, and which launch this is in the checkpoint's history."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, mode: Mode = "run",
                 capabilities: Capabilities | None = None, announce: bool = True,
                 target: Target | None = None) -> None:
        """``read_env`` validates every variable here, and the profile it names is read and checked,
        so a bad value or a malformed profile is one error before any parse."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        environ = os.environ if environ is None else environ
        self.env: EnvSettings = read_env(environ)
        self.profile: Profile | None = None
        if self.env.profile_path:
            from . import profile_file

            self.profile = profile_file.load(self.env.profile_path)
        self.environ = dict(environ)
        self.mode = mode
        self.capabilities = capabilities  # fixed for a plan; detected per parse otherwise
        self.announce = announce and mode == "run"
        self.announced = False  # the start-up table went out (once per process, not per parse)
        self.launch_id: str | None = None  # this launch's line in perf_toggles_history.jsonl
        self.last: Outcome | None = None
        self.target = target  # the job planned for (None: this machine); capabilities are detected for it
        self.context: RunContext | None = None  # the run context this controller belongs to, if any
        self.record_dir: str | None = None  # where perf_toggles.json goes, where a front end names it
        # How a profile's environment is compared with what is found (profile_file.observed): as the
        # mode says, or "doctor", which plans without a target and checks this machine in full.
        self.observing: str = mode

    @property
    def here(self) -> bool:
        """Whether the decisions are for this machine (not a plan for another one)."""
        return self.mode != "plan"

    # -- planning: decisions onto the namespace, nothing else ------------------------------------

    def plan(self, ns: argparse.Namespace, reg: Registration) -> Plan:
        """Decide for this parse and write the decisions onto ``ns``. No other side effect; a
        PerfTogglesError (a request that cannot be honoured) propagates."""
        explicit: dict[str, Any] = dict(reg.explicit)
        for dest in reg.watched:
            value = getattr(ns, dest, UNSET)
            if value is UNSET:
                setattr(ns, dest, reg.stock.get(dest))
            else:
                explicit[dest] = value
        writer = resume.checkpoint_writer(vars(ns))  # reading the resumed run's history is safe
        caps = self.capabilities or for_plan(self.env.assume, target=self.target, env=self.env)
        observed = None
        if self.profile is not None:
            from . import profile_file

            observed = profile_file.observed_for(self.profile, caps, self.environ, self.observing, self.target)
        args = vars(ns)
        if args.get("world_size") is None:  # Megatron's parse_args sets it after this step (memory_guard needs it)
            world = planned_world(self.target, os.environ) or planned_world(None, self.environ)
            args = {**args, "world_size": world}
        try:
            plan = decide(args, explicit, self.env, caps, reg.stock, checkpoint=writer, profile=self.profile,
                          observed=observed, preset=reg.preset, stock_from=reg.stock_from)
        except PerfTogglesError as refusal:
            if reg.speak is not None:  # the refusal's one line in the front end's words
                refusal.message, refusal.hint = reg.speak(refusal.message), refusal.hint and reg.speak(refusal.hint)
                refusal.args = (refusal.message,)
            raise
        if reg.speak is not None:
            in_words(plan, reg.speak)
        original_dirs = {dest: getattr(ns, dest) for dest in plan.log_dirs}
        for dest, decision in plan.decisions.items():
            setattr(ns, dest, decision.value)
        for dest, path in plan.log_dirs.items():
            setattr(ns, dest, path)
        ns.perf_toggles_precision = plan.precision
        ns.perf_toggles = provenance.decision_records(plan)
        if self.here:
            if caps.assumed and not caps.stack:
                plan.messages.append(Message("warning", "MEGATRON_PERF_TOGGLES_ASSUME is set: these decisions rest "
                                             "on planned capabilities, not on this machine's"))
            plan.messages.extend(resume.compare_with_checkpoint(writer, ns.perf_toggles))
        self.last = Outcome(plan, caps, writer, original_dirs)
        if self.context is not None:
            self.context.capabilities = caps
        return plan

    # -- applying: what a real run needs beyond the namespace -------------------------------------

    def apply(self, ns: argparse.Namespace, reg: Registration) -> None:
        """After :meth:`plan`: put the plan into effect for this process (``run`` mode only), and
        let the safety net watch Megatron's validation of ``ns`` (wherever the net is installed)."""
        outcome = self.last
        assert outcome is not None, "apply() follows plan()"
        net = sys.modules.get(f"{__package__}.safety_net")
        watched = net is not None and net.NET.installed
        if self.mode == "run":
            self._install_wgrad_fallback(outcome)
            self._arm_rank_check(ns, outcome)
            if not watched:  # no Megatron validation to wait for: the table goes out now
                self._announce(ns, outcome)
        if watched:
            self.watch(ns, reg)

    def watch(self, ns: argparse.Namespace, reg: Registration) -> None:
        """Let the safety net watch Megatron's validation of ``ns``; once it has passed, the table
        goes out with its final values (a run-time back-off included). A front end whose validation
        comes later than its plan (Primus installs the net before training) calls this then."""
        from .safety_net import NET

        outcome = self.last
        assert outcome is not None, "watch() follows plan()"
        NET.watch(ns, reg.stock, self.on_backoff(outcome), functools.partial(self._validated, outcome=outcome))

    def on_backoff(self, outcome: Outcome) -> Callable[[argparse.Namespace, list[str], str], None]:
        """What a safety net calls when it turned plugin defaults back (a front end's net too)."""
        return functools.partial(self._backed_off, outcome=outcome)

    def _validated(self, ns: argparse.Namespace, *, outcome: Outcome) -> None:
        if self.mode == "run":
            self._announce(ns, outcome)

    def _announce(self, ns: argparse.Namespace, outcome: Outcome) -> None:
        """Rank 0 of a real run, once per process: the start-up table and the records."""
        if self.announce and self.env.rank == 0 and not self.announced:
            self.announced = True
            for line in provenance.lines(outcome.plan, outcome.original_dirs):
                print(line, flush=True)
            self._persist(ns, outcome)

    def _install_wgrad_fallback(self, outcome: Outcome) -> None:
        from . import wgrad_fallback  # install_for decides: the plan's path, and whether it can run here

        wgrad_fallback.install_for(outcome.plan.wgrad_path, outcome.capabilities.is_assumed("wgrad_fallback"))

    def _arm_rank_check(self, ns: argparse.Namespace, outcome: Outcome) -> None:
        from . import rank_check

        fp = rank_check.fingerprint(ns.perf_toggles, outcome.capabilities.to_record(), outcome.plan.wgrad_path)
        rank_check.arm(fp, enabled=self.env.rank_check, context=self.context)

    def _persist(self, ns: argparse.Namespace, outcome: Outcome) -> None:
        """Rank 0 of a real run: the JSON record beside the logs, and the launch history in --save."""
        plan, caps = outcome.plan, outcome.capabilities
        payload = provenance.build_record(plan, caps, self.env.raw_for_record(self.environ), sys.argv)
        directory = self.record_dir or provenance.record_dir(plan, vars(ns))
        try:
            if directory:
                provenance.write_atomic(directory, payload)
            facts = checkpoint_facts(vars(ns), bool(ns.grad_reduce_in_bf16), caps.megatron.version, caps.torch_version)
            self.launch_id = self.launch_id or resume.new_launch_id()
            resume.record_launch(getattr(ns, "save", None), ns.perf_toggles, plan.precision, facts,
                                 launch_id=self.launch_id)
        except OSError as error:
            print(f"{provenance.PREFIX} warning: could not write the provenance record: {error}",
                  file=sys.stderr, flush=True)

    def _backed_off(self, ns: argparse.Namespace, dests: list[str], reason: str, *, outcome: Outcome) -> None:
        """The safety net turned plugin defaults back to Megatron's values: record it everywhere the
        first decision went (the plan, ``args.perf_toggles``, the record, the history, the rank check)."""
        from .safety_net import FOUND_AT_RUN_TIME

        plan = outcome.plan
        sources = {dest: plan.decisions[dest].source for dest in dests}  # before the guard replaces them
        changed = {}
        for dest in dests:
            changed[dest] = plan.decisions[dest] = Decision(getattr(ns, dest), "guard", reason)
        ns.perf_toggles = provenance.decision_records(plan)
        warning = Message("warning", f"Megatron rejected {backed_off_values(sources)}, {FOUND_AT_RUN_TIME}; "
                                     f"{'it was' if len(dests) == 1 else 'they were'} turned back to Megatron's "
                                     "default for this run. Please report it to megatron-perf-toggles so a guard "
                                     "can cover it.")
        plan.messages.append(warning)
        if self.mode != "run":
            return  # a dry run prints the plan itself; a plan for another machine prints nothing
        self._arm_rank_check(ns, outcome)
        if self.env.rank == 0 and self.announced:
            # The table went out already (a back-off while the TransformerConfig was built, after
            # validation): print what changed, once, and rewrite the record and this launch's history line.
            for line in provenance.lines(Plan(changed, plan.precision, {}, [warning], plan.wgrad_path)):
                print(line, flush=True)
            self._persist(ns, outcome)


def new_controller(environ: Mapping[str, str] | None = None, *, mode: Mode = "run",
                   capabilities: Capabilities | None = None, announce: bool = True, target: Target | None = None,
                   context: RunContext | None = None) -> Controller:
    """The one place a :class:`Controller` is made: for ``environ`` (the process's by default), and
    made ``context``'s where one is given (it reads the environment and the profile once, for both).
    A bad variable or profile raises PerfTogglesError here, before any parse."""
    controller = Controller(environ, mode=mode, capabilities=capabilities, announce=announce, target=target)
    if context is not None:
        context.use_controller(controller)
    return controller


def new_context(entry: str, environ: Mapping[str, str] | None = None, *, mode: Mode = "run",
                target: Target | None = None, capabilities: Capabilities | None = None, announce: bool = True,
                controller: bool = True) -> RunContext:
    """The factory every entry point gets its run context from (the provider called bare, the
    launcher, a patched script, planning, the config front ends): the context for ``entry`` and,
    unless ``controller`` is False (the launcher's hooks make theirs at the first parse, once the
    mode is settled), its controller. Not installed: the entry point decides when it owns the process."""
    ctx = RunContext.create(entry, environ, mode=mode, target=target)
    if controller:
        new_controller(ctx.environ, mode=mode, capabilities=capabilities, announce=announce, target=target,
                       context=ctx)
    return ctx


def in_words(plan: Plan, speak: Callable[[str], str]) -> None:
    """Every reason and message of ``plan`` through ``speak`` (a front end's words)."""
    for dest, d in list(plan.decisions.items()):
        plan.decisions[dest] = Decision(d.value, d.source, speak(d.reason))
    for message in plan.messages:
        message.text = speak(message.text)


def backed_off_values(sources: dict[str, str]) -> str:
    """What the safety net took back, named by where each value came from: a profile value is the
    profile's (a reader would otherwise look for the cause in the plugin's defaults)."""
    profile = [d for d, source in sources.items() if source == "profile"]
    defaults = [d for d in sources if d not in profile]
    parts = ([f"the plugin default of {', '.join(defaults)}"] if defaults else []) + \
        ([f"the profile's value of {', '.join(profile)}"] if profile else [])
    return " and ".join(parts)
