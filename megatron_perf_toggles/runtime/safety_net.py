"""The run-time safety net: a plugin default that Megatron's validation rejects is backed off.

The guards in ``decide`` cover every rule of Megatron we know (``megatron_rules``). A Megatron
release can add one we don't. So Megatron's ``validate_args`` and ``core_transformer_config_from_args``
are wrapped: when one of them raises while plugin *defaults* are in play, the net re-runs it on
copies of the namespace with those defaults set back to Megatron's own values, finds the
default(s) Megatron rejects, turns them off (source ``guard``, Megatron's message as the reason),
and lets the run go on, with a warning asking for the rule to be reported.

The rules of the net:
- explicit command-line and environment values are never backed off;
- if the command line fails with every default backed off too, stock Megatron would reject it as
  well, and Megatron's original error surfaces unchanged;
- trial runs print nothing and leave nothing behind (environment, torch's determinism switch,
  warnings and logging state are restored);
- the success path costs one copy of the namespace; Megatron's output of the call is held until it
  returns, so that a re-run never shows it twice.

``NET`` owns the wrappers: ``install(arguments_module)`` / ``uninstall()``; ``install`` registers
the undo with ``process_changes.PROCESS_CHANGES``, the owner of every process-wide change.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import sys
import weakref
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .process_changes import PROCESS_CHANGES
from .rebinding import ORIGINAL_ATTR, megatron_root, rebind

FOUND_AT_RUN_TIME = "a rule found at run time"
# Only values nobody asked for for this run are backed off: defaults, and a profile's values. A
# profile is a set of measured defaults, often confirming the plugin's own; without this a profile
# would take away the net that protects those defaults on a Megatron with a rule nobody listed.
BACKED_OFF_SOURCES = ("default", "profile")
# The Megatron functions the net wraps (in megatron.training.arguments, and wherever imported by name).
TARGETS = ("validate_args", "core_transformer_config_from_args")


class _Entry:
    """What the provider decided for one parsed namespace: enough to back a default off."""

    def __init__(self, ns: Namespace, stock: dict[str, Any], on_backoff: Callable[[Namespace, list[str], str], None],
                 on_validated: Callable[[Namespace], None] | None = None):
        try:
            self.ref: Callable[[], Namespace | None] = weakref.ref(ns)
        except TypeError:  # a namespace without weak references (Primus's SimpleNamespace) is held
            self.ref = lambda: ns
        self.stock = stock
        self.on_backoff = on_backoff
        self.on_validated = on_validated  # called once validate_args has passed, back-offs included
        # The namespace as parsed and how validate_args was called on it: a back-off found while
        # building the TransformerConfig re-validates from here, so what Megatron derives from a
        # toggle follows the backed-off value.
        self.pre_validate: dict[str, Any] | None = None
        self.validate: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None


class SafetyNet:
    """Owner of the wrapped Megatron functions and of the namespaces they watch."""

    def __init__(self) -> None:
        self.originals: dict[str, Callable[..., Any]] = {}
        self.wrappers: dict[str, Callable[..., Any]] = {}
        self.root: str | None = None
        self.module: Any = None
        self._entries: dict[int, _Entry] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    def install(self, arguments: Any) -> None:
        """Wrap ``arguments.validate_args`` (and the TransformerConfig builder) wherever referenced."""
        if self.module is arguments and self.wrappers:
            return
        if self.wrappers:  # another Megatron in this process: move, and let the undo move back
            PROCESS_CHANGES.install("the safety net, off the Megatron it watched before", self.uninstall,
                            functools.partial(self._wrap_all, self.module))
        self._wrap_all(arguments)
        PROCESS_CHANGES.on_uninstall("the safety net (validate_args and the TransformerConfig builder)", self.uninstall)

    def _wrap_all(self, arguments: Any) -> None:
        self.module, self.root = arguments, megatron_root(arguments)
        for name in TARGETS:
            current = getattr(arguments, name, None)
            if current is None:
                continue
            original = getattr(current, ORIGINAL_ATTR, current)
            wrapper = current if current is not original else self._wrap(name, original)
            self.originals[name], self.wrappers[name] = original, wrapper
            rebind(original, wrapper, self.root)

    def uninstall(self) -> None:
        """Put Megatron's own functions back wherever a wrapper was bound."""
        for name, wrapper in self.wrappers.items():
            rebind(wrapper, self.originals[name], self.root)
        self.originals, self.wrappers, self._entries = {}, {}, {}
        self.module = self.root = None

    @property
    def installed(self) -> bool:
        return bool(self.wrappers)

    def watch(self, ns: Namespace, stock: dict[str, Any],
              on_backoff: Callable[[Namespace, list[str], str], None],
              on_validated: Callable[[Namespace], None] | None = None) -> None:
        """Remember what the provider decided for ``ns`` (called right after parsing)."""
        self._entries = {k: e for k, e in self._entries.items() if e.ref() is not None}
        self._entries[id(ns)] = _Entry(ns, stock, on_backoff, on_validated)

    def _entry(self, ns: Any) -> _Entry | None:
        entry = self._entries.get(id(ns))
        return entry if entry is not None and entry.ref() is ns else None

    # -- the net --------------------------------------------------------------------------------

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        validating = name == "validate_args"
        stage = "validation" if validating else "TransformerConfig"

        @functools.wraps(original)
        def wrapper(args: Any, *rest: Any, **kwargs: Any) -> Any:
            entry = self._entry(args)
            if entry is None:
                return original(args, *rest, **kwargs)
            snapshot = _copy(vars(args))
            if validating:
                entry.pre_validate, entry.validate = snapshot, (original, rest, kwargs)
            # Megatron's output of this first call is held back: if the net re-runs the call, only
            # the final run's output is shown (nothing twice); otherwise it is shown as it was.
            held_out, held_err = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stdout(held_out), contextlib.redirect_stderr(held_err):
                    result = original(args, *rest, **kwargs)
            except Exception as error:
                trial = self._trial(validating, original, snapshot, entry, rest, kwargs)
                dests = self._find(trial, snapshot, entry)
                if not dests:
                    _release(held_out, held_err)
                    raise
                message = first_line(error)
            else:
                _release(held_out, held_err)
                if validating and entry.on_validated is not None:
                    entry.on_validated(args)
                return result
            if validating:
                vars(args).clear()
                vars(args).update(_copy(snapshot))
                for dest in dests:
                    setattr(args, dest, entry.stock.get(dest))
            else:
                settled = trial(dests)  # re-validated with the back-off, so derived settings follow it
                if settled is not None:
                    vars(args).clear()
                    vars(args).update(vars(settled))
            entry.on_backoff(args, dests, f"Megatron's {stage} rejected the plugin default, {FOUND_AT_RUN_TIME}: "
                                          f"{message}")
            result = original(args, *rest, **kwargs)
            if validating and entry.on_validated is not None:
                entry.on_validated(args)
            return result

        setattr(wrapper, ORIGINAL_ATTR, original)
        return wrapper

    @staticmethod
    def _trial(validating: bool, original: Callable[..., Any], snapshot: dict[str, Any], entry: _Entry,
               rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[list[str]], Namespace | None]:
        """A quiet, side-effect-free re-run with ``dests`` at Megatron's values: the resulting
        namespace, or None where Megatron still rejects it."""
        revalidate = not validating and entry.pre_validate is not None and entry.validate is not None

        def trial(dests: list[str]) -> Namespace | None:
            ns = Namespace(**_copy(entry.pre_validate if revalidate else snapshot))  # type: ignore[arg-type]
            for dest in dests:
                setattr(ns, dest, entry.stock[dest])
            with quiet_and_undone():
                try:
                    if revalidate:
                        validate, vrest, vkwargs = entry.validate  # type: ignore[misc]
                        validate(ns, *_copy_args(vrest), **_copy(vkwargs))
                    original(ns, *_copy_args(rest), **_copy(kwargs))
                except Exception:  # noqa: BLE001 - a failed trial is an answer
                    return None
            return ns

        return trial

    @staticmethod
    def _find(trial: Callable[[list[str]], Namespace | None], snapshot: dict[str, Any], entry: _Entry) -> list[str]:
        return smallest_backoff(trial, _as_mapping(snapshot.get("perf_toggles")), entry.stock)


def _as_mapping(value: Any) -> dict[str, Any]:
    """The decision records as dicts: Primus turns the dicts on its namespace into SimpleNamespaces."""
    if value is None:
        return {}
    items = value.items() if isinstance(value, Mapping) else vars(value).items()
    return {k: (v if isinstance(v, Mapping) else vars(v)) for k, v in items}


def smallest_backoff(trial: Callable[[list[str]], object | None], records: Mapping[str, Mapping[str, Any]],
                     stock: Mapping[str, Any]) -> list[str]:
    """The smallest set of plugin defaults whose stock values make ``trial`` pass (not None), or
    []: the rule of the net, shared by every front end's validation (Bridge's too)."""
    candidates = [dest for dest, rec in records.items()
                  if rec.get("source") in BACKED_OFF_SOURCES and dest in stock and rec.get("value") != stock[dest]]
    if not candidates or trial(candidates) is None:
        return []  # no default in play, or stock values fail too: not ours to fix
    for dest in candidates:
        if trial([dest]) is not None:
            return [dest]
    chosen: list[str] = []
    for dest in candidates:
        chosen.append(dest)
        if trial(chosen) is not None:
            break
    for dest in list(chosen):
        smaller = [d for d in chosen if d != dest]
        if smaller and trial(smaller) is not None:
            chosen = smaller
    return chosen


NET = SafetyNet()


def _copy_one(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable value (a lock, a module) is shared as it is
        return value


def _copy(values: dict[str, Any]) -> dict[str, Any]:
    """A deep copy, value by value: one value that cannot be copied is shared, the others are not."""
    return {key: _copy_one(value) for key, value in values.items()}


def _copy_args(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_copy_one(value) for value in values)


def _release(out: io.StringIO, err: io.StringIO) -> None:
    """Show output that was held back, on the streams the caller has now."""
    if out.getvalue():
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()
    if err.getvalue():
        sys.stderr.write(err.getvalue())
        sys.stderr.flush()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 240 else line[:237] + "..."


@contextlib.contextmanager
def quiet_and_undone() -> Iterator[None]:
    """Run a trial validation with no output and no lasting effect on process state."""
    import logging  # only when a validation failed: nothing on the success path
    import warnings

    environ = dict(os.environ)
    torch = sys.modules.get("torch")
    deterministic = warn_only = None
    if torch is not None:
        with contextlib.suppress(Exception):
            deterministic = torch.are_deterministic_algorithms_enabled()
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        if torch is not None and deterministic is not None:
            with contextlib.suppress(Exception):
                torch.use_deterministic_algorithms(deterministic, warn_only=bool(warn_only))
