"""The guards in the order they run, and the table of them the docs show.

Every guard is declared once, next to its check (``guards_grads``, ``guards_model``, ``guards_moe``), with the
toggles it may move and the Megatron rules it answers; each module lists its own in the order
it declares them (``guard_base.declared_in``), and this module only puts the modules in order. The
generated table (``guards_table``), the test that every rule marked ``guard`` or ``dependency``
in ``megatron_rules`` has its answer, and the rule-detection tests all read these declarations.
"""

from __future__ import annotations

from . import guards_grads, guards_model, guards_moe
from .guard_base import Guard, Need
from .guards_grads import NEEDS

__all__ = ["GUARDS", "NEEDS", "Guard", "Need", "guards_table"]

# Applied in this order: a later guard sees (and may take back) what an earlier one changed. Each
# module's guards run in the order it declares them; the gradient guards come first.
GUARDS: tuple[Guard, ...] = (*guards_grads.GUARDS, *guards_model.GUARDS, *guards_moe.GUARDS)


def guards_table(guards: tuple[Guard, ...] = GUARDS, needs: tuple[Need, ...] = NEEDS) -> str:
    """The docs' table of guards (in the order they run) and of the features no guard may
    override, each with the Megatron rules it answers."""
    rows = ["| order | guard | may change | answers Megatron's rules |", "|---|---|---|---|"]
    for n, g in enumerate(guards, 1):
        answers = ", ".join(f"`{r.id}`" for r in g.answers) or "none (no Megatron rule: the machine, the checkpoint or the plugin)"
        rows.append(f"| {n} | `{g.name}` | {', '.join(f'`{d}`' for d in g.moves)} | {answers} |")
    rows += ["", "| feature | keeps | at | rule |", "|---|---|---|---|"]
    for need in needs:
        rows.append(f"| `{need.feature.__name__.removeprefix('_needs_')}` | `{need.dest}` | {need.value} "
                    f"| `{need.rule.id}` |")
    return "\n".join(rows)
