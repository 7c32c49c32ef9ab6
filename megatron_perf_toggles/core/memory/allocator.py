"""What PyTorch's caching allocator needs beyond peak allocated memory, and the plan's verdict.

A job does not die when its allocated bytes reach the card's size; it dies when the caching
allocator cannot find a block for the next request. Without expandable segments every segment is
one ``cudaMalloc`` of a fixed size. A request larger than 1 MB is carved from the best-fitting free
block of a cached segment, and a request of 10 MB or more that finds none gets a segment of its
own, rounded up to 2 MB. Memory freed back to the cache stays in its segment, and a segment can be
returned to the driver only when nothing in it is in use. So when a step's largest allocation
(the fp32 copy of the logits, tens of GB on a large vocabulary) is freed, later and smaller
allocations (the optimizer's state made at the first step, the next micro-batch's activations)
are carved from its segment; when the next step asks for the large block again, that segment is
in pieces and a fresh one is needed. The bound the plan uses: without expandable segments, the
allocator needs the peak allocated memory plus the largest allocation that recurs every step.

With ``expandable_segments:True`` a segment is a range of virtual addresses whose 2 MB pages are
mapped and unmapped on demand; free pages are given back under pressure, so a large request needs
only as many free bytes as it asks for. There the need is the peak allocated memory itself.

Both bounds leave out what lives outside the allocator (the CUDA context, cuBLAS and NCCL
workspaces, about 1 to 3 GB): the memory guard's headroom is for that. docs/memory.md has the
derivation and the H200 runs that check it. Pure arithmetic and data: nothing here reads the
process environment or imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import EnvValueError
from ..facts import Capabilities, version_tuple
from .memory_moe import largest_candidates
from .model import BF16, FP32, MB, Layout

Verdict = Literal["fits", "fits_with_expandable_segments", "does_not_fit"]
VERDICTS: tuple[Verdict, ...] = ("fits", "fits_with_expandable_segments", "does_not_fit")
VERDICT_WORDS = {"fits": "fits", "fits_with_expandable_segments": "fits only with expandable segments",
                 "does_not_fit": "does not fit"}

# Where PyTorch reads its allocator settings (the first that is set wins, as in torch >= 2.9; the
# older CUDA and HIP names are still read there).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
# What a launch exports to get it: the variable Megatron's own checks read.
LAUNCH_VAR = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True, slots=True)
class AllocConf:
    """The allocator setting torch will read: the variable, its text, and what the plan needs of it."""

    var: str | None = None  # the first of ALLOC_CONF_VARS that is set (torch reads that one)
    raw: str = ""
    expandable: bool = False  # expandable_segments:True
    async_backend: bool = False  # backend:cudaMallocAsync: not the caching allocator at all

    def with_expandable(self) -> tuple[str, str]:
        """The variable and value a launch exports to turn expandable segments on, keeping the rest."""
        kept = [part for part in self.raw.replace(" ", "").split(",") if part and not part.startswith("expandable_segments")]
        return self.var or LAUNCH_VAR, ",".join([*kept, EXPANDABLE])


def alloc_conf(environ: Mapping[str, str]) -> AllocConf:
    """The allocator setting in ``environ``, parsed as strictly as torch parses it: a value of
    ``expandable_segments`` other than True or False, which torch refuses at its first allocation,
    is refused here first (EnvValueError: one line)."""
    var = next((name for name in ALLOC_CONF_VARS if name in environ), None)
    if var is None:
        return AllocConf()
    raw = environ[var]
    options = dict(part.partition(":")[::2] for part in raw.replace(" ", "").split(",") if part)
    value = options.get("expandable_segments", "False")
    if value not in ("True", "False"):
        raise EnvValueError(var, raw, "expandable_segments:True or expandable_segments:False (torch accepts only these)")
    return AllocConf(var, raw, value == "True", options.get("backend") == "cudaMallocAsync")



@dataclass(frozen=True, slots=True)
class Largest:
    """The largest allocation that recurs every step on a rank: its size and what it is."""

    mb: float
    what: str


def largest_allocation(layout: Layout, values: Mapping[str, Any], stage: str = "last") -> Largest:
    """The step's largest single transient allocation under these toggle values, on a rank of the
    pipeline stage (the last by default; another computes no logits).

    Candidates, each a tensor made and freed once per micro-batch: the logits' fp32 copy (stock's
    cross entropy and the native fusion upcast the bf16 logits), or with Transformer Engine's cross
    entropy only the bf16 logits and their gradient; the first MLP projection's output (a dense
    layer's; an MoE layer's experts': ``core.memory.memory_moe.largest_candidates``, their permuted tokens
    too); and with attention outside a fused kernel (``--transformer-impl local``) the attention
    scores. A stage holding none of these (a first stage with the embedding alone, as a pipeline
    layout may give it) has the embedding's output."""
    tokens_vocab = layout.tokens * layout.vocab_per_rank
    te_ce = bool(values.get("cross_entropy_loss_fusion")) and values.get("cross_entropy_fusion_impl") == "te"
    logits = (BF16 * tokens_vocab / MB, "the bf16 logits (Transformer Engine's cross entropy)") if te_ce \
        else (FP32 * tokens_vocab / MB, "the fp32 copy of the logits in the cross entropy")
    fc1 = layout.ffn * (2 if layout.swiglu else 1) // layout.tp
    count, moe_n = layout.layer_count(stage), layout.moe_layers(stage)
    candidates = []
    if moe_n < count:  # a dense layer's MLP on this stage
        candidates.append((BF16 * layout.tokens * fc1 / MB, "the first MLP projection's output"))
    if layout.moe is not None and moe_n:
        candidates += largest_candidates(layout.moe, layout.hidden, layout.tokens, layout.tp,
                                         layout.sequence_parallel, layout.swiglu, values)
    if stage == "last":
        candidates.append(logits)
    if layout.unfused_attention and count:
        seq = layout.seq // layout.cp
        scores = BF16 * layout.micro_batch * (layout.heads // layout.tp) * seq * seq / MB
        candidates.append((scores, "the attention scores (attention outside a fused kernel)"))
    if not candidates:
        candidates.append((BF16 * layout.tokens * layout.hidden / MB, "the embedding's output"))
    mb, what = max(candidates)
    return Largest(round(mb, 1), what)


def need_mb(stages: list[tuple[float, Largest]], expandable: bool) -> float:
    """What the allocator needs on the busiest rank, given each pipeline stage's peak allocated MB
    and its largest allocation: the peak with expandable segments, else the peak plus the largest
    allocation (see the module), the larger over the stages."""
    return max(peak if expandable else peak + largest.mb for peak, largest in stages)


def verdict(need_fixed: float, need_expandable: float, limit_mb: float, expandable_set: bool,
            expandable_allowed: bool = True) -> Verdict:
    """fits (as launched), fits only with expandable segments, or does not fit."""
    if (need_expandable if expandable_set else need_fixed) <= limit_mb:
        return "fits"
    if not expandable_set and expandable_allowed and need_expandable <= limit_mb:
        return "fits_with_expandable_segments"
    return "does_not_fit"


def worse(a: Verdict, b: Verdict) -> bool:
    """Whether ``a`` is a worse outcome than ``b``."""
    return VERDICTS.index(a) > VERDICTS.index(b)


# --- Megatron's own rules about the allocator setting -------------------------------------------


def expandable_segments_refused(args: Mapping[str, Any], caps: Capabilities) -> str | None:
    """Why Megatron refuses expandable segments for this layout, or None where it accepts them.

    Megatron's DDP config rejects them with NCCL user buffers (``--use-nccl-ub``; from core 0.18 only
    before torch 2.11, an unknown torch counted as older), and core 0.14 and 0.15 reject them with CUDA
    graphs (0.14: the external CUDA graphs only). The rules are detected in the checkout
    (megatron_rules: ``nccl_ub_expandable_segments``, ``cuda_graphs_expandable_segments``)."""
    megatron = caps.megatron
    if args.get("nccl_ub") and megatron.has_rule("nccl_ub_expandable_segments"):
        old_torch = caps.torch_version is None or version_tuple(caps.torch_version) < (2, 11)
        if old_torch or not megatron.has_rule("nccl_ub_expandable_segments_torch"):
            return "Megatron refuses expandable segments with --use-nccl-ub (before torch 2.11)"
    graphs = args.get("external_cuda_graph") or args.get("cuda_graph_impl") not in (None, "none")
    if graphs and megatron.has_rule("cuda_graphs_expandable_segments"):
        return "this Megatron refuses expandable segments with CUDA graphs"
    return None


def te_cuda_graphs(args: Mapping[str, Any], caps: Capabilities) -> bool:
    """Transformer Engine's CUDA graphs are on, where Megatron then asks for NCCL_GRAPH_REGISTER=0
    beside expandable segments (core 0.16 on: ``te_cuda_graphs_nccl_graph_register``)."""
    return args.get("cuda_graph_impl") == "transformer_engine" and caps.megatron.has_rule(
        "te_cuda_graphs_nccl_graph_register")
