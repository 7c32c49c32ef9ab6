"""The guards in the order they run, and the table of them the docs show.

Every guard is declared once, next to its check (``guards_grads``, ``guards_model``), with the
toggles it may move and the Megatron rules it answers; this module only orders them. The
generated table (``guards_table``), the test that every rule marked ``guard`` or ``dependency``
in ``megatron_rules`` has its answer, and the rule-detection tests all read these declarations.
"""

from __future__ import annotations

from .guard_base import Guard, Need
from .guards_grads import (
    NEEDS,
    grad_reduce_checkpoint_layout,
    grad_reduce_yields_to_fp32_accumulation,
    grad_reduce_yields_to_fsdp_comm_dtype,
    gradient_accumulation_fusion_apex,
    gradient_accumulation_fusion_fsdp,
    mxfp4_bf16_wgrad,
)
from .guards_model import (
    cross_entropy_fusion_deterministic,
    cross_entropy_impl_unused,
    cross_entropy_te_asserted,
    cross_entropy_te_distillation,
    cross_entropy_te_full_iteration_graph,
    cross_entropy_te_missing,
    ddp_average_unsupported,
    fused_qkv_rope_unsupported,
)

__all__ = ["GUARDS", "NEEDS", "Guard", "Need", "guards_table"]

# Applied in this order: a later guard sees (and may take back) what an earlier one changed.
GUARDS: tuple[Guard, ...] = (
    grad_reduce_yields_to_fp32_accumulation,
    grad_reduce_yields_to_fsdp_comm_dtype,
    mxfp4_bf16_wgrad,
    grad_reduce_checkpoint_layout,
    cross_entropy_fusion_deterministic,
    cross_entropy_te_asserted,
    cross_entropy_te_distillation,
    cross_entropy_te_full_iteration_graph,
    cross_entropy_te_missing,
    cross_entropy_impl_unused,
    gradient_accumulation_fusion_fsdp,
    gradient_accumulation_fusion_apex,
    fused_qkv_rope_unsupported,
    ddp_average_unsupported,
)


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
