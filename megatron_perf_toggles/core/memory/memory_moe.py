"""Mixture-of-experts layers in the peak-memory model: their weights, what they save for the backward,
and what each MoE toggle changes.

A separate module because an MoE layer's memory has its own parallel layout: the experts are split
over the expert-parallel group (``num_experts / EP`` local experts per rank) and each expert's
linear layers over the expert tensor-parallel group (ETP, Megatron's default: TP), and the
distributed optimizer shards the experts' state over the expert data-parallel group
(``world / (EP x ETP x PP)``), not the dense data-parallel one. ``core.memory.model`` builds a ``Moe``
record from the parsed arguments and adds these terms to its dense ones. Pure arithmetic, as
``core.memory.model`` is; units are MB of 2**20 bytes, per GPU.

Where each term comes from in Megatron-LM (core 0.13 to main, ``megatron/core/transformer/moe/``):
the layer pattern from ``--moe-layer-freq`` (models/gpt/gpt_layer_specs.py), the experts from
experts.py (``TEGroupedMLP`` under ``--moe-grouped-gemm``, else ``SequentialMLP``), the router from
router.py and moe_utils.py (``topk_routing_with_score_function``), the dispatchers from
token_dispatcher.py and the permutation from moe_utils.py (``permute`` / ``unpermute``).
docs/memory.md has the derivations.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MB = 2**20
FP64, FP32, BF16, INT64, INT32, BOOL = 8, 4, 2, 8, 4, 1
MOE_DESTS = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion")
# Transformer Engine's grouped GEMM runs its GEMMs on several cuBLAS streams, each with a workspace
# of its own, made once and kept (transformer_engine/pytorch/module/base.py:
# get_multi_stream_cublas_workspace; 4 streams, 32 MiB each on compute capability 9 and up).
CUBLAS_STREAMS, CUBLAS_WORKSPACE_MB = 4, 32.0
AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


class MoeUnknown(ValueError):
    """The MoE arguments do not describe a layout the model covers; the message says why."""


@dataclass(frozen=True, slots=True)
class Moe:
    """The facts about a job's MoE layers that peak memory depends on, per rank."""

    experts: int
    topk: int
    ffn: int  # --moe-ffn-hidden-size (Megatron's default: --ffn-hidden-size)
    pattern: tuple[bool, ...]  # per layer: an MoE layer (True) or a dense one
    ep: int = 1
    etp: int = 1
    edp: int = 1  # expert data-parallel size: world / (EP x ETP x PP)
    shared_ffn: int = 0  # --moe-shared-expert-intermediate-size
    dispatcher: str = "allgather"  # Megatron's default; alltoall, flex
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    aux_loss: bool = False  # a load-balancing loss with a coefficient above 0
    recompute: str = ""  # what is recomputed: "full" (every layer), "moe" (the MoE part), "moe_act" (its activation)
    legacy_grouped_gemm: bool = False  # --moe-use-legacy-grouped-gemm: the grouped_gemm package, not TE
    probs_bytes: int = BF16  # the routing probabilities' dtype: the router's (--moe-router-dtype, else bf16)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def layers_in(self, first: int, count: int) -> int:
        """How many of ``count`` layers from ``first`` on are MoE layers."""
        return sum(self.pattern[first:first + count])

    def layers_among(self, layers: Iterable[int]) -> int:
        """How many of these layers (a pipeline stage's, not always contiguous: virtual stages
        interleave them) are MoE layers."""
        return sum(1 for i in layers if 0 <= i < len(self.pattern) and self.pattern[i])


# --- from the parsed arguments -------------------------------------------------------------------


def _pattern_value(node: ast.AST) -> Any:
    """A ``--moe-layer-freq`` list expression, such as ``([0]+[1]*23)``: lists of 0 and 1 joined
    with + and repeated with *, as Megatron's ``moe_freq_type`` accepts; nothing else is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise MoeUnknown("--moe-layer-freq is not a list expression of 0 and 1")


def layer_pattern(freq: Any, layers: int) -> tuple[bool, ...]:
    """Which layers are MoE layers: ``--moe-layer-freq N`` makes every N-th layer one, from the
    first (gpt_layer_specs.py: ``i % N == 0``); a list gives each layer (its length must be the
    number of layers, as Megatron asserts)."""
    if isinstance(freq, str):
        text = freq.strip()
        try:
            freq = _pattern_value(ast.parse(text, mode="eval").body) if "[" in text else int(text)
        except MoeUnknown:
            raise
        except (SyntaxError, TypeError, ValueError):
            raise MoeUnknown(f"--moe-layer-freq {text!r} is neither a number nor a list expression of 0 and 1") from None
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise MoeUnknown("--moe-layer-freq is not known")
    if isinstance(freq, int):
        if freq <= 0:
            raise MoeUnknown("--moe-layer-freq must be 1 or more")
        return tuple(i % freq == 0 for i in range(layers))
    if any(v not in (0, 1) or isinstance(v, bool) for v in freq):
        raise MoeUnknown("--moe-layer-freq: a pattern holds 0 (a dense layer) and 1 (an MoE layer) only")
    if len(freq) != layers:
        raise MoeUnknown(f"--moe-layer-freq gives {len(freq)} layers, the model has {layers} (Megatron asserts they match)")
    return tuple(bool(v) for v in freq)


def _positive(args: Mapping[str, Any], dest: str, default: int) -> int:
    value = args.get(dest)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MoeUnknown(f"--{dest.replace('_', '-')} is not known")
    return value


def _aux_loss(args: Mapping[str, Any]) -> bool:
    """A load-balancing loss runs where its type is one of the aux losses and its coefficient is above
    0 (router.py: ``_apply_aux_loss`` returns early on a coefficient of 0; the default is 0.0)."""
    kinds = args.get("moe_router_load_balancing_type") or "aux_loss"
    coeffs = args.get("moe_aux_loss_coeff") or 0.0
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = [coeffs] * len(kinds) if isinstance(coeffs, (int, float, str)) else list(coeffs)
    return any(k in AUX_LOSSES and float(c) > 0 for k, c in zip(kinds, coeffs, strict=False))


def _recompute(args: Mapping[str, Any]) -> str:
    """What selective recompute drops from an MoE layer: with ``moe`` in --recompute-modules the
    whole MoE part is recomputed and only its input kept (moe_layer.py; --moe-layer-recompute, the
    older flag, does the same); with ``moe_act`` the experts' activation (experts.py:
    ``CheckpointWithoutOutput`` around it, so fc2's input is not kept)."""
    if args.get("moe_layer_recompute"):
        return "moe"
    if args.get("recompute_granularity") != "selective":
        return ""
    modules = args.get("recompute_modules") or ()
    modules = [modules] if isinstance(modules, str) else list(modules)
    return "moe" if "moe" in modules else "moe_act" if "moe_act" in modules else ""


def _probs_bytes(args: Mapping[str, Any]) -> int:
    """The router's dtype, which its probabilities keep (router.py: the input's, bf16, unless
    --moe-router-dtype is fp32 or fp64; ``topk_routing_with_score_function`` casts the probabilities
    back to the logits' dtype)."""
    return {"fp32": FP32, "fp64": FP64}.get(str(args.get("moe_router_dtype") or ""), BF16)


def moe_from_args(args: Mapping[str, Any], layers: int, ffn: int, tp: int, pp: int, world: int) -> Moe | None:
    """The MoE layout of a parsed namespace, with Megatron's defaults where a value is not set
    (arguments.py and transformer_config.py: top-k 2, the allgather dispatcher, every layer an MoE
    layer, the expert FFN size the dense one, ETP = TP); None for a dense model. Raises MoeUnknown
    for what the model does not cover."""
    # Megatron's namespace says num_experts; a configuration object (Megatron-Bridge) carries
    # TransformerConfig's num_moe_experts
    experts = args.get("num_experts") or args.get("num_moe_experts")
    if not experts:  # Megatron turns --num-experts 0 into None: a dense model
        return None
    for dest, words in (("moe_latent_size", "MoE latent projections"), ("moe_use_upcycling", "upcycling")):
        if args.get(dest):
            raise MoeUnknown(f"{words} are not in the memory model")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise MoeUnknown("--num-experts is not known")
    ep, etp = _positive(args, "expert_model_parallel_size", 1), _positive(args, "expert_tensor_parallel_size", tp)
    if experts % ep:
        raise MoeUnknown(f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {ep}")
    dispatcher = str(args.get("moe_token_dispatcher_type") or "allgather")
    if dispatcher not in ("allgather", "alltoall", "flex"):
        raise MoeUnknown(f"the {dispatcher} token dispatcher is not in the memory model")
    capacity = args.get("moe_expert_capacity_factor")
    return Moe(
        experts=experts, topk=_positive(args, "moe_router_topk", 2), ffn=_positive(args, "moe_ffn_hidden_size", ffn),
        pattern=layer_pattern(args.get("moe_layer_freq", 1) or 1, layers), ep=ep, etp=etp,
        edp=max(world // (ep * etp * pp), 1), shared_ffn=int(args.get("moe_shared_expert_intermediate_size") or 0),
        dispatcher=dispatcher, capacity_factor=None if capacity in (None, "") else float(capacity),
        pad_to_capacity=bool(args.get("moe_pad_expert_input_to_capacity")), aux_loss=_aux_loss(args),
        recompute="full" if args.get("recompute_granularity") == "full" else _recompute(args),
        legacy_grouped_gemm=bool(args.get("moe_use_legacy_grouped_gemm")), probs_bytes=_probs_bytes(args))


# --- weights -------------------------------------------------------------------------------------


def expert_shapes(moe: Moe, hidden: int, swiglu: bool) -> dict[str, tuple[int, int]]:
    """One local expert's weights on this rank (experts.py: fc1 is ``moe_ffn x 2`` wide with a gated
    unit (SwiGLU), split over ETP by columns; fc2 split over ETP by rows)."""
    fc1 = moe.ffn * (2 if swiglu else 1)
    return {"expert_fc1": (fc1 // moe.etp, hidden), "expert_fc2": (hidden, moe.ffn // moe.etp)}


def shared_shapes(moe: Moe, hidden: int, swiglu: bool, tp: int) -> dict[str, tuple[int, int]]:
    """The shared experts' weights (shared_experts.py: one MLP of the shared intermediate size, split
    over the dense tensor-parallel group, not ETP)."""
    if not moe.shared_ffn:
        return {}
    fc1 = moe.shared_ffn * (2 if swiglu else 1)
    return {"shared_fc1": (fc1 // tp, hidden), "shared_fc2": (hidden, moe.shared_ffn // tp)}


def expert_params(moe: Moe, hidden: int, swiglu: bool) -> int:
    """An MoE layer's expert parameters on this rank: its local experts' fc1 and fc2."""
    return moe.local_experts * sum(r * c for r, c in expert_shapes(moe, hidden, swiglu).values())


def moe_dense_params(moe: Moe, hidden: int, swiglu: bool, tp: int) -> int:
    """An MoE layer's parameters outside the experts, beside attention and the norms: the router's
    weight (router.py: ``num_experts x hidden``, replicated) and the shared experts."""
    return moe.experts * hidden + sum(r * c for r, c in shared_shapes(moe, hidden, swiglu, tp).values())


def expert_bytes_per_param(moe: Moe, distributed_optimizer: bool) -> float:
    """The experts' 18 B per parameter (bf16 weight, fp32 gradient, fp32 main weight, two Adam
    moments), of which the distributed optimizer shards the 12 B of optimizer state over the expert
    data-parallel group (distributed/distributed_data_parallel.py builds the experts' buffers on
    ``expt_dp``)."""
    return 6 + 12 / moe.edp if distributed_optimizer else 18


# --- activations, per MoE layer and micro-batch ----------------------------------------------------


def routed_tokens(moe: Moe, tokens: int, tp: int, sp: bool) -> float:
    """Tokens the rank's local experts compute for one micro-batch (``tokens``: the micro-batch's
    tokens on the rank before sequence parallelism splits them).

    The MoE layer's input is the attention's sequence-parallel shard (tokens / TP, the attention's TP).
    alltoall / flex: each rank permutes its own tokens x top-k, the all-to-all exchanges them over
    EP (in balance each rank gets as many back), and with ETP > 1 they are gathered over ETP.
    allgather: the tokens of the ETP x EP ranks are gathered (``gathered_rows``) and the rank keeps
    those routed to its E / EP experts: in balance the same, tokens x top-k x ETP. A capacity factor
    caps each expert at ``ceil(tokens x topk / E x factor)`` (moe_utils.py ``get_capacity``);
    padding to capacity makes every expert take exactly that many."""
    layer_tokens = tokens / tp if sp else tokens
    routed = layer_tokens * moe.topk * moe.etp
    if moe.capacity_factor is None:
        return routed
    capped = math.ceil(routed / moe.experts * moe.capacity_factor) * moe.experts
    return capped if moe.pad_to_capacity else min(routed, capped)


def gathered_rows(moe: Moe, layer_tokens: float) -> float:
    """The rows the allgather dispatcher permutes: its tokens, routing map and probabilities gathered
    over the expert tensor-and-model-parallel group, ETP x EP (token_dispatcher.py: ``tp_ep_group``,
    only where ETP > 1 or EP > 1); the rank's own tokens otherwise (and for the other dispatchers)."""
    if moe.dispatcher == "allgather" and (moe.etp > 1 or moe.ep > 1):
        return layer_tokens * moe.etp * moe.ep
    return layer_tokens


def expert_activation_bytes(moe: Moe, hidden: int, routed: float, swiglu: bool) -> float:
    """What the experts save for the backward, the same with grouped GEMM and with SequentialMLP
    (experts.py: each keeps its fc1 input, the permuted tokens; the activation keeps fc1's output,
    ``2 x moe_ffn`` wide under SwiGLU; fc2 keeps the activation's output; the probability-weighted
    activation keeps the permuted probabilities, in the router's dtype). All split over ETP but the input."""
    fc1 = moe.ffn * (2 if swiglu else 1) // moe.etp
    activation = 0 if moe.recompute == "moe_act" else moe.ffn // moe.etp
    return routed * (BF16 * (hidden + fc1 + activation) + moe.probs_bytes)


def shared_activation_bytes(moe: Moe, layer_tokens: float, tp: int, sp: bool, swiglu: bool) -> float:
    """The shared experts' MLP keeps fc1's output (twice as wide under SwiGLU) and the activation's
    (its input is the norm's output, which the router keeps already), split over TP; the
    column-parallel fc1 sees every token of the sequence-parallel group."""
    if not moe.shared_ffn:
        return 0.0
    rows = layer_tokens * (tp if sp else 1)
    return rows * BF16 * ((2 if swiglu else 1) + 1) * moe.shared_ffn / tp


def router_bytes(moe: Moe, layer_tokens: float, fused: bool) -> float:
    """What the router saves for the backward (router.py, moe_utils.py).

    Unfused (``topk_routing_with_score_function``): top-k on the logits keeps its int64 indices,
    the softmax over the k chosen keeps its fp32 output, and the scatter of the probabilities into
    a tokens x experts tensor keeps the same indices tensor (no second copy): tokens x k x (8 + 4) B.
    Fused (Transformer Engine's ``fused_topk_with_score_function``): one fp32 intermediate of
    tokens x experts and the bool routing map: tokens x E x (4 + 1) B.
    An aux loss adds its fp32 scores over every expert either way (``compute_routing_scores_for_aux_loss``
    keeps the softmax output; the fused kernel its fp32 intermediate): tokens x E x 4 B."""
    if fused:
        saved = layer_tokens * moe.experts * (FP32 + BOOL)
    else:
        saved = layer_tokens * moe.topk * (INT64 + FP32)
    return saved + (layer_tokens * moe.experts * FP32 if moe.aux_loss else 0.0)


def permute_bytes(moe: Moe, layer_tokens: float, fused: bool, routed: float = 0.0) -> float:
    """What the dispatcher's permutation keeps until the backward (moe_utils.py ``permute`` and
    ``sort_chunks_by_idxs``, token_dispatcher.py; ``routed``: the tokens the rank's experts compute).

    alltoall / flex permute the rank's own tokens over every expert. Unfused: the permuted tokens
    come from ``index_select`` (which keeps its int64 indices, also the unpermute's scatter index)
    and the permuted probabilities from indexing with the flat sorted order (int64 again): tokens x
    k x 8 B each; sorting the received tokens by local expert is a split and a cat, which keep
    nothing. Fused (Transformer Engine's ``moe_permute_with_probs``): an int32 row-id map of tokens
    x (2 E + 1), and with more than one local expert the chunk sort's int32 map of the routed
    tokens, once for the dispatch and once for the combine.
    allgather permutes the gathered rows (``gathered_rows``) over its E / EP local experts, without
    the probabilities: unfused, ``index_select``'s int64 index of the routed tokens; fused, the
    row-id map of rows x (2 E / EP + 1) int32. Either way ``dispatch_postprocess`` picks the local
    probabilities with ``masked_select``, which keeps its input (rows x E / EP, the router's dtype)
    and its bool mask."""
    if moe.dispatcher == "allgather":
        rows, local = gathered_rows(moe, layer_tokens), moe.local_experts
        index = rows * (2 * local + 1) * INT32 if fused else routed * INT64
        return index + rows * local * (moe.probs_bytes + BOOL)
    if fused:
        chunk_sorts = 2 if moe.local_experts > 1 else 0
        return layer_tokens * (2 * moe.experts + 1) * INT32 + chunk_sorts * routed * INT32
    return 2 * layer_tokens * moe.topk * INT64


def moe_layer_bytes(moe: Moe, hidden: int, tokens: int, tp: int, sp: bool, swiglu: bool,
                    values: Mapping[str, Any]) -> float:
    """One MoE layer's MLP part for one micro-batch: the experts, the shared experts, the router and
    the dispatcher (the attention part and the norms are the dense layer's, ``core.memory.model``)."""
    layer_tokens = tokens / tp if sp else tokens
    # recomputed: only the MoE part's input is kept, the pre-MLP norm's output, which the attention
    # part's 18 x s x b x h counts already (full recompute: core.memory.model keeps each layer's input)
    if moe.recompute in ("moe", "full"):
        return 0.0
    routed = routed_tokens(moe, tokens, tp, sp)
    return (expert_activation_bytes(moe, hidden, routed, swiglu) + shared_activation_bytes(moe, layer_tokens, tp, sp, swiglu)
            + router_bytes(moe, layer_tokens, bool(values.get("moe_router_fusion")))
            + permute_bytes(moe, layer_tokens, bool(values.get("moe_permute_fusion")), routed))


# --- what stays allocated, and the largest allocation ----------------------------------------------


def persistent_mb(moe: Moe, hidden: int, tokens: int, tp: int, sp: bool, values: Mapping[str, Any]) -> dict[str, float]:
    """Buffers made once and kept: grouped GEMM's cuBLAS workspaces, and the allgather dispatcher's
    gathered tokens, which live in Megatron's global memory buffer (``use_global_buffer=True``)
    kept at its largest size, where ETP > 1 or EP > 1: ``gathered_rows`` x hidden in bf16."""
    out = {}
    if values.get("moe_grouped_gemm") and not moe.legacy_grouped_gemm:
        out["grouped_gemm_workspaces"] = CUBLAS_STREAMS * CUBLAS_WORKSPACE_MB
    if moe.dispatcher == "allgather" and (moe.etp > 1 or moe.ep > 1):
        out["allgather_buffer"] = BF16 * gathered_rows(moe, tokens / tp if sp else tokens) * hidden / MB
    return out


def largest_candidates(moe: Moe, hidden: int, tokens: int, tp: int, sp: bool, swiglu: bool,
                       values: Mapping[str, Any]) -> list[tuple[float, str]]:
    """The MoE layer's largest allocations made and freed every micro-batch: the permuted tokens, and
    fc1's output: one tensor over every local expert with grouped GEMM, one expert's at a time with
    SequentialMLP (which runs the experts one after another)."""
    routed = routed_tokens(moe, tokens, tp, sp)
    fc1 = moe.ffn * (2 if swiglu else 1) // moe.etp
    per = routed if values.get("moe_grouped_gemm") else routed / moe.local_experts
    return [(BF16 * routed * hidden / MB, "the experts' permuted tokens"),
            (BF16 * per * fc1 / MB, "the experts' first projection output"
             + (" (grouped GEMM: every local expert at once)" if values.get("moe_grouped_gemm") else ""))]


# --- the MoE toggles' terms ------------------------------------------------------------------------


def toggle_delta_mb(dest: str, values: Mapping[str, Any], stock: Mapping[str, Any], moe: Moe, hidden: int,
                    tokens: int, tp: int, sp: bool, layers_in_flight: int) -> float:
    """The change in peak MB that ``values[dest]`` makes against ``stock[dest]`` for one of
    MOE_DESTS (``layers_in_flight``: the stage's MoE layers times the micro-batches whose
    activations it holds at once).

    moe_grouped_gemm: + the cuBLAS workspaces Transformer Engine's grouped GEMM keeps (4 x 32 MiB);
    what the experts save for the backward is the same either way (``expert_activation_bytes``).
    moe_permute_fusion: the fused row-id map instead of the unfused int64 indices, per MoE layer.
    moe_router_fusion: the fused kernel's fp32 tokens x experts intermediate and bool map instead of
    the unfused top-k's tokens x k indices and probabilities, per MoE layer."""
    now, before = bool(values.get(dest)), bool(stock.get(dest))
    if now == before:
        return 0.0
    sign = 1 if now else -1
    layer_tokens = tokens / tp if sp else tokens
    if dest == "moe_grouped_gemm":  # the legacy grouped_gemm package keeps no cuBLAS workspaces
        return 0.0 if moe.legacy_grouped_gemm else sign * CUBLAS_STREAMS * CUBLAS_WORKSPACE_MB
    if moe.recompute in ("moe", "full"):  # the router's and the permutation's tensors are recomputed, not kept
        return 0.0
    if dest == "moe_permute_fusion":
        routed = routed_tokens(moe, tokens, tp, sp)
        change = permute_bytes(moe, layer_tokens, True, routed) - permute_bytes(moe, layer_tokens, False, routed)
    elif dest == "moe_router_fusion":
        change = router_bytes(moe, layer_tokens, True) - router_bytes(moe, layer_tokens, False)
    else:
        raise KeyError(dest)
    return sign * layers_in_flight * change / MB
