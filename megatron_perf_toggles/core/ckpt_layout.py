"""Whether a Megatron checkpoint names its optimizer state by the gradient-buffer dtype.

GRAD_REDUCE_IN_BF16 changes the dtype of the gradient buffers. The distributed optimizer saves
its state per buffer, and several of Megatron's layouts name each buffer by its (param dtype,
grad dtype) pair: then a checkpoint saved with one value cannot be loaded with the other. This
was seen on Megatron main (torch_dist, dp_reshardable): a KeyError inside the load. The
model-space layouts name state by parameter instead, and a run without the distributed optimizer
keeps no per-buffer state.

The rules below come from Megatron's checkpointing code (how the sharding type is chosen, 0.13 to
main), keyed on which arguments the parser has, so no version table is needed:
  - ``--ckpt-format torch``: the distributed optimizer's ``distrib_optim.pt`` is per buffer dtype;
  - torch_dist before 0.15 (no ``--dist-ckpt-optim-fully-reshardable``), and 0.15 with
    ``--dist-ckpt-save-pre-mcore-014`` or a torch older than 2.6: fully_sharded_model_space with
    the (default) fully parallel save, else dp_zero_gather_scatter;
  - torch_dist from 0.15: fully_reshardable when asked for, else dp_reshardable;
  - ``--ckpt-format fsdp_dtensor``: per parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .facts import version_tuple

GRAD_DTYPE_KEYED = "grad-dtype-keyed"
MODEL_SPACE = "model-space"
NO_OPTIMIZER_BUFFERS = "no-distributed-optimizer"


def optimizer_layout(args: Mapping[str, Any], megatron_version: str | None = None,
                     torch_version: str | None = None) -> tuple[str, str]:
    """(kind, Megatron's name for the layout) of the checkpoint a run with ``args`` saves; the
    versions are those capabilities report (None when unknown)."""
    if not args.get("use_distributed_optimizer"):
        return NO_OPTIMIZER_BUFFERS, "no distributed optimizer"
    fmt = args.get("ckpt_format") or "torch_dist"
    if fmt == "fsdp_dtensor":
        return MODEL_SPACE, "fsdp_dtensor"
    if fmt == "torch":
        return GRAD_DTYPE_KEYED, "torch format, distrib_optim.pt per buffer dtype"
    torch_vt = version_tuple(torch_version or "")
    pre_014 = "dist_ckpt_optim_fully_reshardable" not in args or (
        version_tuple(megatron_version or "")[:2] == (0, 15)
        and (bool(args.get("dist_ckpt_save_pre_mcore_014")) or (bool(torch_vt) and torch_vt[:2] < (2, 6)))
    )
    if pre_014:
        if args.get("ckpt_fully_parallel_save"):
            return MODEL_SPACE, "fully_sharded_model_space"
        return GRAD_DTYPE_KEYED, "dp_zero_gather_scatter"
    if args.get("dist_ckpt_optim_fully_reshardable"):
        return MODEL_SPACE, "fully_reshardable"
    return GRAD_DTYPE_KEYED, "dp_reshardable"


def loads_optimizer_state(args: Mapping[str, Any]) -> bool:
    """Whether Megatron will load optimizer state from ``--load``. Finetuning, ``--no-load-optim``
    and what validate_args turns into them later (MoE upcycling, ``--skip-train`` outside RL,
    ``--freeze-all-layers``) start it fresh."""
    return bool(args.get("load")) and not any((
        args.get("no_load_optim"), args.get("finetune"), args.get("moe_use_upcycling"),
        args.get("skip_train") and not args.get("perform_rl_step"), args.get("freeze_all_layers"),
    ))


def grad_buffer_dtype(args: Mapping[str, Any], grad_reduce_in_bf16: bool) -> str:
    """The dtype of the DDP gradient buffers, as validate_args settles it: fp32 when gradients
    accumulate in fp32, else the parameters' dtype. GRAD_REDUCE_IN_BF16 only matters under --bf16
    with fp32 main grads."""
    in_fp32 = bool(args.get("accumulate_allreduce_grads_in_fp32"))
    if args.get("bf16"):
        if grad_reduce_in_bf16:
            return "bf16"
        main = str(args.get("main_grads_dtype") or "fp32")
        return "fp32" if in_fp32 or main in ("fp32", "float32", "torch.float32") else "bf16"
    if args.get("fp16"):
        return "fp32" if in_fp32 else "fp16"
    return "fp32"


def checkpoint_facts(args: Mapping[str, Any], grad_reduce_in_bf16: bool, megatron_version: str | None = None,
                     torch_version: str | None = None) -> dict[str, Any]:
    """What a launch records about the checkpoints it will save (resume.py's history)."""
    return {"optimizer_layout": list(optimizer_layout(args, megatron_version, torch_version)),
            "grad_buffer_dtype": grad_buffer_dtype(args, grad_reduce_in_bf16),
            "optimizer_state_saved": not args.get("no_save_optim")}
