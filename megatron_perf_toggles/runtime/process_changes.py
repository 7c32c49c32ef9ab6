"""The one owner of every process-wide change the plugin makes, and of its undo.

Not editing Megatron means changing the process around it: a module in ``sys.modules`` and
attributes of Megatron's layers (the wgrad fallback), Megatron functions rebound across every
module that imported them (the parse hooks, the safety net), ``torch.distributed``'s
``init_process_group`` (the rank check), ``sys.stdout`` in a dry run, ``typing.override`` on
Pythons before 3.12. Each of those goes through :data:`PROCESS_CHANGES`, which records what was there
before; ``PROCESS_CHANGES.uninstall()`` puts every change back, newest first, so that a test, ``explain``
or an application embedding Megatron can return the process to where it was.

A :class:`ProcessChanges` of one's own is a scoped owner: the dry run's stand-ins for the planned
world and GPU use one for the length of Megatron's parse and validate. :meth:`ProcessChanges.scope`
does the same for the shared owner: planning in-process (``explain --megatron``) hooks Megatron's
parse path and installs the safety net like a launch does, and leaves none of it behind.

This is an undo log only: the plugin's state (controller, parse hooks, rank fingerprint, the
planned target) lives on the run context (``context.py``), not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Undo:
    """One entry of the undo log: the change to the process (for people) and how to take it back."""

    label: str
    undo: Callable[[], object]  # what it returns (a rebind's count) is not used


def _current(owner: Any, name: str) -> Any:
    # The owner's own namespace, not a module's __getattr__ (Megatron and our stand-ins define
    # one); an inherited class attribute counts as absent, so undo deletes the copy set here.
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:  # no __dict__ (slots)
        return getattr(owner, name, _MISSING)


class ProcessChanges:
    """Records changes as they are made; :meth:`uninstall` undoes them in reverse order."""

    def __init__(self) -> None:
        self._changes: list[Undo] = []

    def install(self, label: str, apply: Callable[[], object], undo: Callable[[], object]) -> None:
        """Make a change by calling ``apply`` and own it: ``undo`` takes it back on uninstall."""
        apply()
        self._changes.append(Undo(label, undo))

    def set_attr(self, owner: Any, name: str, value: Any, label: str | None = None) -> None:
        """``setattr(owner, name, value)``, remembering the old value (or its absence)."""
        old = _current(owner, name)

        def undo() -> None:
            if old is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)

        setattr(owner, name, value)
        self._changes.append(Undo(label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", undo))

    def set_item(self, mapping: MutableMapping[str, Any], key: str, value: Any, label: str | None = None) -> None:
        """``mapping[key] = value`` (``sys.modules``, ``os.environ``), remembering the old entry."""
        old = mapping.get(key, _MISSING)

        def undo() -> None:
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        mapping[key] = value
        self._changes.append(Undo(label or f"[{key!r}]", undo))

    def on_uninstall(self, label: str, undo: Callable[[], object]) -> None:
        """A change already made elsewhere (rebinding a function across modules), with its own undo."""
        self._changes.append(Undo(label, undo))

    def uninstall(self) -> None:
        """Undo every recorded change, newest first. Idempotent."""
        self.undo_to(0)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Changes recorded inside the block are undone, newest first, when it ends; older ones stay."""
        mark = self.mark()
        try:
            yield
        finally:
            self.undo_to(mark)

    def mark(self) -> int:
        """A point in the log to come back to with :meth:`undo_to` (a run context's install)."""
        return len(self._changes)

    def undo_to(self, mark: int) -> None:
        """Undo the changes recorded after ``mark``, newest first."""
        while len(self._changes) > mark:
            self._changes.pop().undo()

    @property
    def labels(self) -> list[str]:
        """What is changed right now, oldest first."""
        return [c.label for c in self._changes]


PROCESS_CHANGES = ProcessChanges()
