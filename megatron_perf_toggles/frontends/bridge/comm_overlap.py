"""What a Bridge recipe's ``cfg.comm_overlap`` will set on the model, read before Bridge sets it.

Bridge keeps communication-overlap choices (deferred embedding wgrad, delayed wgrad, the MoE
expert-parallel overlap, overlapped gradient reduction, ...) in ``cfg.comm_overlap``, a
``CommOverlapConfig``, and copies every value the recipe gave (not ``None``) onto the model, DDP
and optimizer configs only in ``runtime_config_update``, after ``apply`` has decided. Fields
there carry Megatron's own names, so the guards read them as Megatron's arguments: the GPT-3 175B
recipe's ``defer_embedding_wgrad_compute=True`` needs gradient-accumulation fusion on, as
``--defer-embedding-wgrad-compute`` does on the argparse path, and the reasons name the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any

# Fields of CommOverlapConfig that are no Megatron argument a decision reads (TE's userbuffer
# layout, its bootstrap backend, the world Bridge works out itself).
NOT_ARGUMENTS = frozenset({"tp_comm_overlap_cfg", "tp_comm_bootstrap_backend", "data_parallel_size"})


def carried(cfg: Any) -> dict[str, Any]:
    """The values ``cfg.comm_overlap`` gives (the recipe's, as Bridge will apply them), by Megatron's names."""
    overlap = getattr(cfg, "comm_overlap", None)
    if overlap is None or not dataclasses.is_dataclass(overlap):
        return {}
    user = getattr(overlap, "user_comm_overlap_cfg", None)  # where Bridge keeps them once finalized
    source = user if user is not None and dataclasses.is_dataclass(user) else overlap
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(source)
            if f.name not in NOT_ARGUMENTS and getattr(source, f.name, None) is not None}


def overlay(cfg: Any, args: MutableMapping[str, Any], words: MutableMapping[str, str]) -> list[str]:
    """Put what ``cfg.comm_overlap`` carries into ``args`` (Megatron's dests) with its field path in
    ``words``, as ``runtime_config_update`` will put it on the model; returns the names set."""
    named = carried(cfg)
    for name, value in named.items():
        args[name] = value
        words[name] = f"cfg.comm_overlap.{name}"
    return sorted(named)
