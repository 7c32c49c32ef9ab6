"""What a guard is: one declaration holding its check, the toggles it may move and the Megatron
rules it answers, plus the predicates several guards share.

A rule is named by its MegatronRule object (``rule(id)`` binds one at import, so an id that
``megatron_rules`` does not declare stops the package from loading), never by a bare string in a
guard's body. The guard order (``guards.GUARDS``), the generated guard table and the tests that
check every rule has an answer all read these declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import RegistryError
from ..ckpt_layout import loads_optimizer_state
from ..decision.plan import Change, Check, Context
from ..facts import Capabilities, version_tuple
from ..registry import BY_DEST
from .megatron_rules import BY_ID, MegatronRule


def rule(rule_id: str) -> MegatronRule:
    """The declared rule ``rule_id``: guards bind these once, at import."""
    try:
        return BY_ID[rule_id]
    except KeyError:
        raise RegistryError(f"no Megatron rule {rule_id!r} is declared in core/rules/megatron_rules.py") from None


@dataclass(frozen=True, slots=True)
class Guard:
    """One guard: ``check`` proposes changes to ``moves`` (the toggles it may change), in answer to
    ``answers`` (Megatron's rules it exists for; empty for a guard about the machine or the plugin)."""

    check: Check
    moves: tuple[str, ...]
    answers: tuple[MegatronRule, ...] = ()

    @property
    def name(self) -> str:
        return self.check.__name__

    def __call__(self, ctx: Context) -> Iterator[Change]:
        return self.check(ctx)


def declared_in(namespace: Mapping[str, Any]) -> tuple[Guard, ...]:
    """The guards a module declares, in the order it declares them (a module's namespace keeps
    definition order): each guard module's ``GUARDS``, so that no guard is listed by hand."""
    return tuple(value for value in namespace.values() if isinstance(value, Guard))


def guard(*, moves: tuple[str, ...], answers: tuple[MegatronRule, ...] = ()) -> Callable[[Check], Guard]:
    """Declare the function below as a guard (see ``Guard``)."""
    return lambda check: Guard(check, moves, answers)


@dataclass(frozen=True, slots=True)
class Need:
    """A feature the user asked for that needs ``dest`` at ``value`` under Megatron's ``rule``:
    ``feature`` names the request (or None where it was not made); no guard may take it away."""

    dest: str
    value: Any
    rule: MegatronRule
    feature: Callable[[Context], str | None]


def carries(ctx: Context, megatron_rule: MegatronRule) -> bool:
    """Whether the Megatron at hand enforces ``megatron_rule`` (an unknown Megatron is assumed to)."""
    return ctx.caps.megatron.has_rule(megatron_rule.id)


def is_on(values: Mapping[str, Any], dest: str) -> bool:
    return bool(values.get(dest))


def resume_loads_optimizer(ctx: Context) -> bool:
    """Whether the resume loads optimizer state: the arguments allow it (``loads_optimizer_state``),
    the checkpoint holds some, and Megatron does not load weights alone (a release checkpoint, or its
    fallback to --pretrained-checkpoint, which finetunes)."""
    ck = ctx.checkpoint or {}
    return loads_optimizer_state(ctx.args) and ck.get("optimizer_state_saved") is not False \
        and not ck.get("weights_only")


def as_saved(ctx: Context, dest: str) -> bool | None:
    """A toggle as the checkpoint being resumed was saved with: as its launch recorded it; where none
    did, stock saved it as the command line or config gives it (None: nothing to guard), else as
    Megatron's default."""
    recorded = (ctx.checkpoint or {}).get("decisions", {}).get(dest)
    if recorded is not None:
        return bool(recorded)
    return None if ctx.sources.get(dest) in ("cli", "config") else bool(BY_DEST[dest].stock_default)


def graph_modules(args: Mapping[str, Any]) -> set[str]:
    """The CUDA graph scopes the command line names, by their short names."""
    names: set[str] = set()
    for dest in ("cuda_graph_modules", "cuda_graph_scope", "cuda_graph_scope_deprecated"):
        value = args.get(dest) or ()
        for item in [value] if isinstance(value, str) else value:
            names.add(str(getattr(item, "name", item)).rsplit(".", 1)[-1])
    return names



def te_at_least(caps: Capabilities, minimum: tuple[int, ...]) -> bool:
    """Transformer Engine is there in at least ``minimum``; one whose version could not be read
    (``unknown``) is taken as recent rather than blamed for a rule it may well satisfy."""
    if caps.te_version is None:
        return False
    found = version_tuple(caps.te_version)
    return not found or found >= minimum


def lacking(ctx: Context, dest: str) -> str | None:
    """The first capability that the toggle's fast value needs (``Toggle.needs`` in the registry)
    and that this machine lacks: ``False``, not merely unknown (``None``)."""
    return next((need for need in BY_DEST[dest].needs if ctx.caps.value_of(need) is False), None)
