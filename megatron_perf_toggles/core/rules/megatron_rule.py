"""The record of one of Megatron-LM's rules (``MegatronRule``): its own module, so that the tables of
rules (``megatron_rules``, ``megatron_rules_allocator``) can each import it. Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Stage = Literal["validate", "config", "runtime"]


@dataclass(frozen=True, slots=True)
class MegatronRule:
    """One of Megatron's rules about a toggle.

    ``phrase`` is a short piece of Megatron's source that identifies the rule in ``where`` (paths
    relative to the checkout), empty where no phrase marks it (then it is documented, not detected);
    ``stage`` says when Megatron enforces it: parse+validate, building the TransformerConfig, or
    only at run time (model wrapping, first step); ``versions`` are the supported releases that
    carry it (recorded from real trees; a test re-checks them); ``handling`` is the plugin's
    answer: the guard that covers it, or why none is needed. ``fact`` names the ``MegatronFacts``
    field that states it for a Megatron whose rules were not read (a hand-built or older record);
    ``if_unknown``: whether a Megatron known neither way is assumed to carry it.
    """

    id: str
    toggles: tuple[str, ...]
    where: tuple[str, ...]
    phrase: str
    stage: Stage
    versions: tuple[str, ...]
    summary: str
    handling: str
    fact: str = ""
    if_unknown: bool = True
