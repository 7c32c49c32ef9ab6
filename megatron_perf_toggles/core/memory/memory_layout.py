"""The layout of a GPT job, per rank, as the peak-memory model reads it from Megatron's parsed arguments.

Split from ``core.memory.model`` (which re-exports every name here): the few facts peak memory depends on
(sizes, parallel layout, precision, recompute, the MoE layers of ``core.memory.memory_moe``, each
pipeline rank's layers from ``core.memory.pipeline_split``) and the parameters each pipeline stage
holds. Pure arithmetic over the parsed namespace.

A stage is named ``last``, ``first`` (with PP > 1) or ``rank N`` (a middle pipeline rank, counted
from 0 as Megatron counts them): the plan's records and words use these names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import memory_moe
from .memory_moe import Moe, MoeUnknown, moe_from_args
from .pipeline_split import SplitUnknown, read_split


@dataclass(frozen=True, slots=True)
class Layout:
    """The few facts about a GPT job that peak memory depends on, per rank (``moe``: its MoE layers)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    query_groups: int
    kv_channels: int
    seq: int
    micro_batch: int
    padded_vocab: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    untied: bool = True
    swiglu: bool = True
    distributed_optimizer: bool = False
    recompute: str | None = None  # None | "selective" | "full"
    bias: bool = False
    fp8: bool = False  # TE keeps an fp8 copy of each transformer layer's linear weights
    fp32_grad_buffer: bool = True  # stock's gradient buffer is fp32 (bf16 training with fp32 main grads)
    unfused_attention: bool = False  # --transformer-impl local: attention scores are materialised
    moe: Moe | None = None  # the mixture-of-experts layers (core.memory.memory_moe); None: a dense model
    # per pipeline rank, the decoder layers it builds (core.memory.pipeline_split); None: an even split
    split: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        """A split must be this layout's (a ``dataclasses.replace`` of PP or the layer count drops it
        with ``split=None``): a stale one would price another job's stages."""
        if self.split is not None and (len(self.split) != self.pp or sum(map(len, self.split)) != self.layers):
            raise ValueError(f"a pipeline split of {len(self.split)} ranks and {sum(map(len, self.split))} layers "
                             f"is not this layout's ({self.pp} stages, {self.layers} layers)")

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank: the logits' rows (the output layer gathers the
        sequence-parallel shards back, so SP does not divide them; CP does)."""
        return self.seq // self.cp * self.micro_batch

    @property
    def vocab_per_rank(self) -> int:
        return self.padded_vocab // self.tp

    # --- the pipeline stages: which layers each holds, how the plan names it ---------------------

    def rank_layers(self, rank: int) -> tuple[int, ...]:
        """The decoder layers pipeline rank ``rank`` builds: the split read from the arguments
        (``core.memory.pipeline_split``), or without one an even split (each rank ceil(N / PP)
        layers, the last rank the last ones)."""
        if self.split is not None:
            return tuple(self.split[rank])
        per = math.ceil(self.layers / self.pp)
        start = max(self.layers - per, 0) if rank == self.pp - 1 else rank * per
        return tuple(range(start, min(start + per, self.layers)))

    def stage_rank(self, stage: str) -> int:
        """The pipeline rank a stage name means: ``last``, ``first`` (with PP > 1) or ``rank N``."""
        if stage == "last":
            return self.pp - 1
        if stage == "first":
            return 0
        rank = int(stage.removeprefix("rank "))
        if not 0 <= rank < self.pp:
            raise ValueError(f"no pipeline stage {stage!r} with PP {self.pp}")
        return rank

    def stage_name(self, rank: int) -> str:
        """The name the plan gives pipeline rank ``rank``'s stage (``stage_rank`` reads it back)."""
        return "last" if rank == self.pp - 1 else "first" if rank == 0 else f"rank {rank}"

    def stage_layer_ids(self, stage: str = "last") -> tuple[int, ...]:
        return self.rank_layers(self.stage_rank(stage))

    def layer_count(self, stage: str = "last") -> int:
        """The decoder layers the stage builds."""
        return len(self.stage_layer_ids(stage))

    def in_flight(self, stage: str = "last") -> int:
        """Micro-batches whose activations the stage holds at once in the 1F1B schedule: PP on the
        first, one fewer on each later rank, one on the last."""
        return self.pp - self.stage_rank(stage)

    def priced_stages(self) -> list[str]:
        """The stages a peak is worked out for: the last, the first (PP > 1), and a middle rank whose
        layers (their number, its MoE layers among them) no earlier rank's match. A middle rank whose
        layers an earlier one (the first included) matches holds no more than that one in any term:
        the same weights and shapes, no more micro-batches in flight, no embedding, no logits."""
        if self.pp == 1:
            return ["last"]
        seen = {(self.layer_count("first"), self.moe_layers("first"))}
        out = ["last", "first"]
        for rank in range(1, self.pp - 1):
            name = self.stage_name(rank)
            kind = (self.layer_count(name), self.moe_layers(name))
            if kind not in seen:
                seen.add(kind)
                out.append(name)
        return out

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each distinct weight matrix of one transformer layer on this rank (rows, columns)."""
        q = self.heads * self.kv_channels
        kv = 2 * self.query_groups * self.kv_channels
        fc1 = self.ffn * (2 if self.swiglu else 1)
        return {"qkv": ((q + kv) // self.tp, self.hidden), "proj": (self.hidden, q // self.tp),
                "fc1": (fc1 // self.tp, self.hidden), "fc2": (self.hidden, self.ffn // self.tp)}

    def layer_params(self) -> int:
        """One dense layer's parameters on this rank."""
        weights = sum(r * c for r, c in self.linear_shapes().values())
        return weights + 2 * self.hidden  # two RMSNorm/LayerNorm weights (replicated across TP)

    def attention_params(self) -> int:
        shapes = self.linear_shapes()
        return sum(r * c for name, (r, c) in shapes.items() if name in ("qkv", "proj"))

    def moe_layer_params(self) -> tuple[int, int]:
        """One MoE layer's parameters on this rank: (outside the experts: attention, the norms, the
        router and the shared experts; the local experts'), which the distributed optimizer shards
        over different groups."""
        moe = self.moe
        assert moe is not None
        dense = self.attention_params() + 2 * self.hidden + memory_moe.moe_dense_params(moe, self.hidden, self.swiglu, self.tp)
        return dense, memory_moe.expert_params(moe, self.hidden, self.swiglu)

    def moe_layers(self, stage: str = "last") -> int:
        """The MoE layers among the stage's layers."""
        return 0 if self.moe is None else self.moe.layers_among(self.stage_layer_ids(stage))

    def stage_param_split(self, stage: str = "last") -> tuple[int, int]:
        """Parameters on one rank of the stage: (dense, expert). Dense: its layers outside the
        experts, the final norm and the output layer on the last stage (its own weight when untied;
        a copy of the embedding when tied and PP > 1), the input embedding on the first (both when
        PP == 1)."""
        rank = self.stage_rank(stage)
        moe_n = self.moe_layers(stage)
        dense = (self.layer_count(stage) - moe_n) * self.layer_params()
        expert = 0
        if moe_n:
            moe_dense, expert_layer = self.moe_layer_params()
            dense, expert = dense + moe_n * moe_dense, moe_n * expert_layer
        if rank == self.pp - 1:
            dense += self.hidden + self.embedding_params()
            if self.pp == 1 and self.untied:
                dense += self.embedding_params()
        elif rank == 0:
            dense += self.embedding_params()
        return dense, expert

    def weight_shapes(self, stage: str = "last") -> set[tuple[int, int]]:
        """Each distinct linear weight shape of the stage's layers on this rank: attention's where it
        holds a layer, the dense MLP's where it holds a dense layer, the experts' and the shared
        experts' where it holds an MoE layer."""
        count, moe_n = self.layer_count(stage), self.moe_layers(stage)
        shapes = self.linear_shapes()
        out = {shapes["qkv"], shapes["proj"]} if count else set()
        if count > moe_n:
            out |= {shapes["fc1"], shapes["fc2"]}
        if self.moe is not None and moe_n:
            out |= set(memory_moe.expert_shapes(self.moe, self.hidden, self.swiglu).values())
            out |= set(memory_moe.shared_shapes(self.moe, self.hidden, self.swiglu, self.tp).values())
        return out

    def stage_linear_weights(self, stage: str = "last") -> int:
        """The linear layers' weights of the stage's layers (what FP8 keeps a 1-byte copy of)."""
        moe_n = self.moe_layers(stage)
        dense = (self.layer_count(stage) - moe_n) * sum(r * c for r, c in self.linear_shapes().values())
        if self.moe is None or not moe_n:
            return dense
        shared = sum(r * c for r, c in memory_moe.shared_shapes(self.moe, self.hidden, self.swiglu, self.tp).values())
        moe_layer = self.attention_params() + shared + memory_moe.expert_params(self.moe, self.hidden, self.swiglu)
        return dense + moe_n * moe_layer  # the router stays in its own precision: no FP8 copy

    def embedding_params(self) -> int:
        return self.vocab_per_rank * self.hidden

    def stage_params(self, stage: str = "last") -> int:
        """Parameters on one rank of the stage (``stage_param_split``), experts included."""
        return sum(self.stage_param_split(stage))

    def last_stage_params(self) -> int:
        return self.stage_params("last")

    def first_stage_params(self) -> int:
        return self.stage_params("first" if self.pp > 1 else "last")


class Unknown(Exception):
    """The arguments do not describe a layout the model covers; the message says why."""


def _int(args: Mapping[str, Any], dest: str, default: int | None = None) -> int:
    value = args.get(dest)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise Unknown(f"--{dest.replace('_', '-')} is not known")
    return value


def padded_vocab(args: Mapping[str, Any]) -> int:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP
    (training/tokenizer: the padded size is computed where the tokenizer is built)."""
    padded = args.get("padded_vocab_size")
    if isinstance(padded, int) and padded > 0:
        return padded
    vocab = args.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise Unknown("the vocabulary size is not known before the tokenizer loads (pass --vocab-size)")
    multiple = (args.get("make_vocab_size_divisible_by") or 128) * (args.get("tensor_model_parallel_size") or 1)
    return -(-vocab // multiple) * multiple


def layout_from_args(args: Mapping[str, Any]) -> Layout:
    """The layout Megatron's parsed (and validated) namespace describes; raises Unknown for what the
    model does not cover (MLA, hybrid models, a vocabulary not known yet, the MoE variants
    ``core.memory.memory_moe`` leaves out, a pipeline split ``core.memory.pipeline_split`` cannot
    read: pricing it as an even split would name the wrong stage and the wrong peak)."""
    for dest, words in (("multi_latent_attention", "multi-latent attention"),
                        ("hybrid_override_pattern", "hybrid (Mamba) layers"), ("mtp_num_layers", "multi-token prediction")):
        if args.get(dest):
            raise Unknown(f"{words} are not in the memory model")
    hidden = _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    groups = _int(args, "num_query_groups", heads) if args.get("group_query_attention") else heads
    tp = _int(args, "tensor_model_parallel_size", 1)
    pp, cp = _int(args, "pipeline_model_parallel_size", 1), _int(args, "context_parallel_size", 1)
    world = args.get("world_size")
    # validate_args sets data_parallel_size; before it, the world size (parse_args reads WORLD_SIZE) gives it
    dp_default = world // (tp * pp * cp) if isinstance(world, int) and world >= tp * pp * cp else 1
    recompute = args.get("recompute_granularity")
    dp = _int(args, "data_parallel_size", max(dp_default, 1))
    ffn, layers = _int(args, "ffn_hidden_size", 4 * hidden), _int(args, "num_layers")
    try:
        moe = moe_from_args(args, layers, ffn, tp, pp, dp * tp * pp * cp)
        split, chunks = read_split(args, layers, pp)
        if chunks > 1 and len({len(r) for r in split}) > 1:
            raise SplitUnknown("virtual pipeline stages over ranks of different layer counts: the interleaved "
                               "schedule keeps a different number of micro-batch passes on each rank than the 1F1B "
                               "count the memory model uses, so which rank peaks is not known")
    except (MoeUnknown, SplitUnknown) as why:
        raise Unknown(str(why)) from None
    return Layout(
        hidden=hidden, ffn=ffn, layers=layers,
        heads=heads, query_groups=groups, kv_channels=_int(args, "kv_channels", hidden // heads),
        seq=_int(args, "seq_length"), micro_batch=_int(args, "micro_batch_size"), padded_vocab=padded_vocab(args),
        tp=tp, pp=pp, cp=cp, dp=dp,
        sequence_parallel=bool(args.get("sequence_parallel")) and tp > 1,
        untied=bool(args.get("untie_embeddings_and_output_weights")), swiglu=bool(args.get("swiglu")),
        distributed_optimizer=bool(args.get("use_distributed_optimizer")),
        recompute=recompute if recompute in ("selective", "full") else None,
        bias=bool(args.get("add_bias_linear", False)), fp8=bool(args.get("fp8") or args.get("fp8_format")),
        fp32_grad_buffer=_fp32_grad_buffer(args), unfused_attention=args.get("transformer_impl") == "local",
        moe=moe, split=split,
    )


def _fp32_grad_buffer(args: Mapping[str, Any]) -> bool:
    """Whether stock keeps the gradient buffer in fp32, which is what --grad-reduce-in-bf16 halves.
    validate_args reads --grad-reduce-in-bf16 only under --bf16 (there it clears
    accumulate_allreduce_grads_in_fp32); fp16 and fp32 training keep the buffer in the parameters'
    dtype either way, and --main-grads-dtype bf16 has it in bf16 already."""
    main_grads = str(args.get("main_grads_dtype") or "fp32").lower()
    return bool(args.get("bf16")) and "bf16" not in main_grads and "bfloat16" not in main_grads


