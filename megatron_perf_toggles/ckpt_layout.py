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
    ``--dist-ckpt-save-pre-mcore-014``: fully_sharded_model_space with the (default)
    fully parallel save, else dp_zero_gather_scatter;
  - torch_dist from 0.15: fully_reshardable when asked for, else dp_reshardable;
  - ``--ckpt-format fsdp_dtensor``: per parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GRAD_DTYPE_KEYED = "grad-dtype-keyed"
MODEL_SPACE = "model-space"
NO_OPTIMIZER_BUFFERS = "no-distributed-optimizer"


def optimizer_layout(args: Mapping[str, Any], megatron_version: tuple[int, ...] = ()) -> tuple[str, str]:
    """(kind, Megatron's name for the layout) of the checkpoint a run with ``args`` saves."""
    if not args.get("use_distributed_optimizer"):
        return NO_OPTIMIZER_BUFFERS, "no distributed optimizer"
    fmt = args.get("ckpt_format") or "torch_dist"
    if fmt == "fsdp_dtensor":
        return MODEL_SPACE, "fsdp_dtensor"
    if fmt == "torch":
        return GRAD_DTYPE_KEYED, "torch format, distrib_optim.pt per buffer dtype"
    pre_014 = "dist_ckpt_optim_fully_reshardable" not in args or (
        megatron_version[:2] == (0, 15) and bool(args.get("dist_ckpt_save_pre_mcore_014"))
    )
    if pre_014:
        if args.get("ckpt_fully_parallel_save"):
            return MODEL_SPACE, "fully_sharded_model_space"
        return GRAD_DTYPE_KEYED, "dp_zero_gather_scatter"
    if args.get("dist_ckpt_optim_fully_reshardable"):
        return MODEL_SPACE, "fully_reshardable"
    return GRAD_DTYPE_KEYED, "dp_reshardable"


def loads_optimizer_state(args: Mapping[str, Any]) -> bool:
    """Whether Megatron will load optimizer state from ``--load`` (finetuning and
    ``--no-load-optim`` start it fresh)."""
    return bool(args.get("load")) and not args.get("no_load_optim") and not args.get("finetune")
