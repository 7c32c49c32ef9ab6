"""One rank's shard of the user's layout, as sizes: what the layer-level check builds on its one GPU.

Under tensor parallelism a rank holds 1/TP of the attention heads, query groups, MLP width and
vocabulary; under expert parallelism 1/EP of the experts (and 1/ETP of each expert's width); under
context parallelism 1/CP of the sequence; with sequence parallelism the MoE layer sees 1/TP of the
tokens. The check builds modules of these sizes with every parallel size set to 1, so they fit one
GPU and need no other rank; the communication between ranks is not in what it times, and the
report says so. Pure: sizes from the parsed arguments, no Megatron import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.registry import flag_of
from ...errors import PerfTogglesError

PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size")


@dataclass(frozen=True, slots=True)
class Shard:
    """Sizes of one rank's modules (``tokens``: per micro-batch into a layer's MLP or MoE block)."""

    tp: int
    ep: int
    etp: int
    cp: int
    pp: int
    seq: int  # the sequence one rank's attention sees (seq / CP)
    micro_batch: int
    tokens: int  # tokens into a rank's MoE layer or MLP (seq / CP * micro-batch, / TP with SP)
    expert_tokens: int  # tokens a rank's local experts take: the alltoall dispatcher gathers them over ETP
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int
    experts: int  # all experts (the router and the dispatcher's permute see all of them)
    local_experts: int
    moe_ffn: int
    vocab: int  # the rank's slice of the padded vocabulary

    def describe(self) -> str:
        """One line: which rank's share is built, or that the layout is one GPU's already."""
        parts = [f"{name} {n}" for name, n in (("TP", self.tp), ("EP", self.ep), ("ETP", self.etp), ("CP", self.cp),
                                                ("PP", self.pp)) if n > 1]
        if not parts:
            return "the layout is one GPU's: modules built at full size"
        return (f"{', '.join(parts)}: one rank's shard built on this GPU with every parallel size 1 "
                f"(heads {self.heads}, query groups {self.query_groups}, MLP width {self.ffn}, "
                f"local experts {self.local_experts} of {self.experts}, vocabulary slice {self.vocab}, "
                f"{self.tokens} tokens per micro-batch); the communication between ranks is not timed")


def _size(args: Mapping[str, Any], dest: str) -> int:
    value = args.get(dest)
    return int(value) if value else 1


def _divided(total: int, by: int, what: str) -> int:
    if total % by:
        raise PerfTogglesError(f"{what} {total} is not divisible by {by}", "Megatron would refuse this layout too")
    return total // by


def _vocab(args: Mapping[str, Any], tp: int) -> int:
    """The rank's vocabulary slice: Megatron pads the vocabulary to a multiple of
    make_vocab_size_divisible_by x TP, then splits it over TP."""
    padded = args.get("padded_vocab_size")
    if not padded:
        vocab = int(args.get("vocab_size") or 0)
        if not vocab:
            return 0
        multiple = int(args.get("make_vocab_size_divisible_by") or 128) * tp
        padded = -(-vocab // multiple) * multiple
    return int(padded) // tp


REQUIRED = ("hidden_size", "num_attention_heads", "seq_length", "num_layers")


def shard_of(args: Mapping[str, Any]) -> Shard:
    """The shard of one rank of the layout the parsed (validated) arguments describe."""
    missing = [d for d in REQUIRED if not args.get(d)]
    if missing:
        raise PerfTogglesError(f"the layer check needs the model's sizes: {', '.join(flag_of(d) for d in missing)} "
                               "not given", "give them with your Megatron arguments")
    tp, pp, cp, ep = (_size(args, d) for d in PARALLEL[:4])
    etp = int(args.get("expert_tensor_parallel_size") or tp)
    hidden = int(args["hidden_size"])
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    seq = _divided(int(args["seq_length"]), cp, "--seq-length over CP:")
    mbs = int(args.get("micro_batch_size") or 1)
    tokens = seq * mbs // (tp if args.get("sequence_parallel") else 1)
    experts = int(args.get("num_experts") or 0)
    ffn = int(args.get("ffn_hidden_size") or 4 * hidden)
    moe_ffn = int(args.get("moe_ffn_hidden_size") or ffn)
    return Shard(
        tp=tp, ep=ep, etp=etp, cp=cp, pp=pp, seq=seq, micro_batch=mbs, tokens=tokens, expert_tokens=tokens * etp,
        heads=_divided(heads, tp, "--num-attention-heads over TP:"),
        query_groups=max(1, groups // tp),  # fewer groups than TP ranks: each rank holds one whole group
        kv_channels=int(args.get("kv_channels") or hidden // heads),
        ffn=_divided(ffn, tp, "--ffn-hidden-size over TP:"),
        experts=experts,
        local_experts=_divided(experts, ep, "--num-experts over EP:") if experts else 0,
        moe_ffn=_divided(moe_ffn, etp, "--moe-ffn-hidden-size over ETP:") if experts else 0,
        vocab=_vocab(args, tp),
    )


def one_gpu_args(args: Mapping[str, Any], shard: Shard) -> dict[str, Any]:
    """The arguments a module of the shard is built from: every parallel size 1 and the sizes one
    rank holds (the shared expert split over TP as its MLP is), what needs another rank off (the
    expert-parallel overlap, the flex dispatcher's all-to-all, which asserts TP x EP > 1: the
    alltoall dispatcher's calls stand in; the deferred embedding wgrad, which Megatron's config
    refuses at PP 1), the rest as the user's plan has them."""
    out = dict(args)
    out.update({d: 1 for d in PARALLEL})
    out.update(sequence_parallel=False, num_attention_heads=shard.heads, num_query_groups=shard.query_groups,
               kv_channels=shard.kv_channels, ffn_hidden_size=shard.ffn, seq_length=shard.seq,
               world_size=1, data_parallel_size=1, overlap_moe_expert_parallel_comm=False,
               defer_embedding_wgrad_compute=False)
    if shard.experts:
        out.update(moe_ffn_hidden_size=shard.moe_ffn)
        shared = args.get("moe_shared_expert_intermediate_size")
        if shared:
            out["moe_shared_expert_intermediate_size"] = int(shared) // shard.tp
        if args.get("moe_token_dispatcher_type") == "flex":
            out["moe_token_dispatcher_type"] = "alltoall"
    return out


DENSE = {"num_experts": None, "moe_ffn_hidden_size": None, "moe_shared_expert_intermediate_size": None,
         "moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_router_fusion": False, "moe_layer_freq": 1,
         "moe_router_num_groups": None, "moe_router_group_topk": None}
"""What a dense unit (attention, an MLP) of an MoE model is built with: no expert settings, which
Megatron's config refuses without experts."""


def unit_changes(unit: str, shard: Shard) -> dict[str, Any]:
    """What a unit's config changes from the shard's arguments: the router and the dispatcher see
    every expert, the MoE layer (and a layer's weight gradients) the rank's local experts (routed
    among them alone: group-limited routing over all experts cannot be kept at that count), the
    dense units no expert settings."""
    if unit in ("router", "dispatcher"):
        return {"num_experts": shard.experts}
    if unit in ("moe_layer", "layer_wgrad") and shard.experts:
        local = {"num_experts": shard.local_experts}
        return {**local, "moe_router_num_groups": None, "moe_router_group_topk": None} if shard.ep > 1 else local
    return dict(DENSE)
