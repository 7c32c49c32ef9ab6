"""One explicit object for the plugin's state in a process: :class:`RunContext`.

Each entry point makes one and passes it down: the bare ``extra_args_provider`` (when nothing else
made one), the launcher (``python -m megatron_perf_toggles.run``), the patched-script hook
(``hooks.install_from_argv``) and planning (``explain`` / ``ablate`` / ``tune`` through a checkout).
It holds what used to live in module globals and in the undo log: the environment and the settings
read from it, the profile, the mode, the job a plan is for (``target``), the controller, the
launcher's parse hooks and the rank check's fingerprint.

The one process slot, :data:`_CURRENT`, exists only because Megatron calls the bare
``extra_args_provider(parser)`` (and ``check_ranks()`` is called bare after ``init_process_group``):
nothing can be passed through those calls. :meth:`RunContext.install` fills the slot through the
undo log (``process_changes.ProcessChanges``), so :meth:`RunContext.uninstall` (or the end of a ``with``
block) puts back whatever was there and undoes every change recorded since.

A dry run is a mode of the context. Where the caller wants the record back instead of a printed
report (``mode="plan"``), the code that finishes the plan calls :meth:`RunContext.stop`, which keeps
the record on the context and leaves Megatron's call stack through an exception private to this
module; only :meth:`RunContext.until_stopped`, used by the entry point that made the context,
catches it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .process_changes import PROCESS_CHANGES, ProcessChanges

if TYPE_CHECKING:  # types only: the context imports nothing heavy when it loads
    from ..core.env import EnvSettings
    from ..core.facts import Capabilities
    from ..core.profile import Profile
    from .controller import Controller
    from .machine.target import Target

Mode = Literal["run", "dry-run", "plan"]
MODES: tuple[Mode, ...] = ("run", "dry-run", "plan")

_CURRENT: RunContext | None = None  # the installed context; see the module docstring for why a slot exists


class _Stopped(Exception):  # private: never seen outside this module
    """Leaves Megatron's call stack once a capturing dry run has its record."""

    def __init__(self, context: RunContext) -> None:
        super().__init__("dry run done")
        self.context = context


@dataclass(slots=True)
class FrontEnd:
    """What a configuration front end's run leaves for its later hooks (the validation it watches):
    the object it planned (a Bridge ``ConfigContainer``, Primus's namespace), the namespace the plan
    was written to, the controller's registration, and a refusal kept until the front end's own
    checks can stop the job with it (Primus)."""

    config: Any
    view: Any = None
    registration: Any = None  # controller.Registration; typed loosely, as ``hooks`` is
    refusal: BaseException | None = None


@dataclass(slots=True)
class RunContext:
    """What the plugin knows and holds in one process, made by one entry point."""

    environ: Mapping[str, str]
    mode: Mode = "run"
    entry: str = ""  # the entry point that made it: provider | launcher | script | planning | rank check
    target: Target | None = None  # the world and GPU a dry run or plan is for; None: this machine
    env: EnvSettings | None = None  # read once, when the controller is made (a bad variable: one line)
    profile: Profile | None = None
    capabilities: Capabilities | None = None  # the last plan's, detected with ``target`` passed in
    controller: Controller | None = None
    hooks: Any = None  # launcher.parse_hooks.Hooks; typed loosely so runtime never imports launcher
    rank_fingerprint: dict[str, Any] | None = None  # this rank's decisions, for check_ranks()
    undo: ProcessChanges = field(default_factory=lambda: PROCESS_CHANGES)  # the undo log (only that)
    record: dict[str, Any] | None = None  # a capturing dry run's record, set by stop()
    args: Any = None  # the namespace that dry run validated (Megatron's own types: enums, dtypes), set by stop()
    plan: Any = None  # and its plan
    front: FrontEnd | None = None  # a configuration front end's planned object (Bridge, Primus)
    _mark: int | None = None

    @classmethod
    def create(cls, entry: str, environ: Mapping[str, str] | None = None, mode: Mode = "run",
               target: Target | None = None, undo: ProcessChanges | None = None) -> RunContext:
        """A context for ``entry``; ``environ`` defaults to the process's environment."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        return cls(os.environ if environ is None else environ, mode, entry, target, undo=undo or PROCESS_CHANGES)

    @property
    def installed(self) -> bool:
        return self._mark is not None

    def use_controller(self, controller: Controller | None) -> None:
        """Make ``controller`` this context's (it read the environment and profile once: keep them)."""
        self.controller = controller
        if controller is not None:
            controller.context = self
            self.env, self.profile = controller.env, controller.profile

    def install(self) -> RunContext:
        """Fill the process slot with this context, through the undo log. Idempotent."""
        if self._mark is None:
            self._mark = self.undo.mark()
            self.undo.set_attr(sys.modules[__name__], "_CURRENT", self, f"run context ({self.mode})")
        return self

    def uninstall(self) -> None:
        """Undo every change recorded since :meth:`install`, newest first, the slot included."""
        if self._mark is not None:
            mark, self._mark = self._mark, None
            self.undo.undo_to(mark)

    def __enter__(self) -> RunContext:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def stop(self, record: dict[str, Any], plan: Any, args: Any = None) -> None:
        """A capturing dry run has its record (and the validated arguments): keep them here and leave
        Megatron's call stack."""
        self.record, self.plan, self.args = record, plan, args
        raise _Stopped(self)

    @contextmanager
    def until_stopped(self) -> Iterator[None]:
        """The block ends quietly where :meth:`stop` of this context is called inside it."""
        try:
            yield
        except _Stopped as stopped:
            if stopped.context is not self:
                raise


def current() -> RunContext | None:
    """The installed context, if any."""
    return _CURRENT


def for_process(entry: str) -> RunContext:
    """The installed context, or, where none is (a controller used on its own, whose rank check
    ``check_ranks()`` must still find), one for ``entry`` installed for the process."""
    return _CURRENT or RunContext.create(entry).install()
