"""The launch environment: variables Megatron's ``validate_args`` checks for some layouts.

Megatron asserts on a few environment variables that a launch script, not the command line,
sets: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tensor or context parallelism before Blackwell,
``NCCL_ALGO`` in deterministic mode, and so on. A dry run planned on a laptop has none of them,
so without help it stops on the first. The rules below say which a layout needs; a dry run sets
those that are unset for its own parse and validation only, and lists them under "launch
environment" so that the user can copy them into the launch. Pure data and a function of the
parsed arguments: nothing here reads the process environment by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .facts import version_tuple

NCCL_ALGO_CHOICES = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
FSDP_DESTS = ("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp")
GTP_DESTS = ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards")


@dataclass(frozen=True, slots=True)
class LaunchVar:
    """One variable the launch needs: its value, and the layout that asks for it."""

    name: str
    value: str
    why: str

    def to_record(self) -> dict[str, str]:
        return {"name": self.name, "value": self.value, "why": self.why}


def _more_than_one(args: Mapping[str, Any], dest: str) -> bool:
    value = args.get(dest)
    return isinstance(value, int) and value > 1


def needed(args: Mapping[str, Any], arch_major: int | None, te_version: str | None) -> list[LaunchVar]:
    """The variables this layout needs at launch, whatever is set now. ``arch_major`` is the
    planned GPU's compute capability major (None: unknown, taken as before Blackwell)."""
    out: list[LaunchVar] = []
    model_parallel = _more_than_one(args, "tensor_model_parallel_size") or _more_than_one(args, "context_parallel_size")
    pre_blackwell = arch_major is None or arch_major < 10
    if model_parallel and pre_blackwell and not any(args.get(d) for d in FSDP_DESTS) \
            and not args.get("overlap_moe_expert_parallel_comm"):
        out.append(LaunchVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                             "tensor or context parallelism before Blackwell: Megatron asserts it"))
    if args.get("deterministic_mode"):
        out.append(LaunchVar("NCCL_ALGO", "Ring", "--deterministic-mode: Megatron asserts one of "
                             + ", ".join(NCCL_ALGO_CHOICES)))
    te = version_tuple(te_version) if te_version else ()
    if args.get("fine_grained_activation_offloading") and te >= (2, 10):
        out.append(LaunchVar("NVTE_CPU_OFFLOAD_V1", "1",
                             "--fine-grained-activation-offloading with Transformer Engine >= 2.10"))
    gtp = any(_more_than_one(args, d) for d in GTP_DESTS)
    if gtp and arch_major is not None and arch_major >= 10 and args.get("cuda_graph_impl") not in (None, "none"):
        out.append(LaunchVar("CUDA_GRAPHS_USE_NODE_PRIORITY", "1",
                             "tensor-parallel weight shards (GTP) with CUDA graphs on Blackwell or later"))
    return out


def from_memory(memory: Mapping[str, Any] | None) -> list[LaunchVar]:
    """What the memory plan asks of the launch (``Plan.memory``'s ``launch_environment``): the
    allocator setting where only expandable segments make the job fit (core.memory.memory_guard)."""
    return [LaunchVar(v["name"], v["value"], v["why"]) for v in (memory or {}).get("launch_environment") or ()]


def missing(launch: list[LaunchVar], environ: Mapping[str, str]) -> list[LaunchVar]:
    """What a plan sets for its own validation: the needed variables that are unset (or, for
    NCCL_ALGO, set to a value Megatron refuses). A value the user set is kept: it is theirs."""
    out = []
    for var in launch:
        current = environ.get(var.name)
        if current is None or (var.name == "NCCL_ALGO" and current not in NCCL_ALGO_CHOICES):
            out.append(var)
    return out


def arch_major_of(gpu_arch: str | None) -> int | None:
    """``sm_90`` -> 9, ``sm_100`` -> 10, ``gfx942`` -> 9 (what torch reports as the major on ROCm)."""
    if not gpu_arch:
        return None
    if gpu_arch.startswith("sm_"):
        digits = gpu_arch[3:]
        return int(digits[:-1]) if digits.isdigit() and len(digits) >= 2 else None
    if gpu_arch.startswith("gfx"):
        return 9
    return None
