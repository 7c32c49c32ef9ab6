"""One builder per unit (``units.UNITS``): each builds the module stock and with the toggle, from the
same seed (and the same weights where the two have the same layout), draws the inputs once, and
hands back a ``Pair`` of steps, each one forward and backward.

These follow the code paths Megatron's training takes: its TransformerConfig from the arguments,
the Transformer Engine layer spec pretrain_gpt builds, its router, dispatcher functions, MoE layer,
output layer and loss function; only the communication between ranks is left out (one rank here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...core.registry import Toggle
from . import gpu_build as gb
from .shard import Shard, unit_changes

MOE_FUSIONS = ("moe_router_fusion", "moe_permute_fusion")


@dataclass(slots=True)
class Pair:
    """The two arms of one toggle's unit, ready to time."""

    stock: gb.Step
    toggle: gb.Step
    same_weights: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class Job:
    """What a builder needs: the shard's arguments, sizes, the toggle, the seed and the plan's gradient
    buffer type."""

    args: Mapping[str, Any]
    shard: Shard
    toggle: Toggle
    seed: int
    bf16_main_grads: bool

    def config(self, on: bool, **more: Any) -> Any:
        return gb.config_for(self.args, **{self.toggle.dest: on, **more})


def _pair(job: Job, make: Callable[[Any], Any], run: Callable[[Any], gb.Step], **more: Any) -> Pair:
    """Build the module for both arms from one seed, share the weights where possible, wrap each as a step."""
    modules = []
    for on in (False, True):
        gb.seeded(job.seed)
        config = job.config(on, **more)
        modules.append(gb.on_gpu(make(config), config))
    same = gb.same_weights(modules[0], modules[1])
    stock, toggle = (gb.with_main_grads(m, run(m), job.bf16_main_grads) for m in modules)
    return Pair(stock, toggle, same)


def _tokens_input(job: Job) -> Any:
    s = job.shard
    return gb.randn((s.tokens // s.micro_batch, s.micro_batch, int(job.args["hidden_size"])), gb.generator(job.seed),
                    requires_grad=True)


def _forward_backward(module_call: Callable[[Any], Any], x: Any) -> gb.Step:
    """A step: forward on ``x``, backward of a fixed output gradient (drawn at the first call)."""
    grad: list[Any] = []

    def step() -> None:
        x.grad = None
        out = module_call(x)
        out = out[0] if isinstance(out, tuple) else out
        if not grad:
            grad.append(gb.randn(tuple(out.shape), gb.generator(1)).to(out.dtype))
        out.backward(grad[0])

    return step


def router(job: Job) -> Pair:
    from megatron.core.transformer.moe.router import TopKRouter

    x = _tokens_input(job)

    def run(module: Any) -> gb.Step:
        return _forward_backward(lambda t: _probs(module(t)), x)

    return _pair(job, lambda config: _router(TopKRouter, config), run, **unit_changes("router", job.shard))


def _router(cls: Any, config: Any) -> Any:
    """Megatron's router for this config, with the process groups where it takes them."""
    import inspect

    return cls(config=config, **gb.groups_for(inspect.signature(cls).parameters))


def _probs(routed: Any) -> Any:
    """The router's output as the layer uses it: the probabilities (their gradient flows back)."""
    probs = routed[0] if isinstance(routed, tuple) else routed
    return probs


def dispatcher(job: Job) -> Pair:
    """Permute and unpermute over all experts, routed once by the stock router (the same routing for
    both arms); the alltoall dispatcher permutes the probabilities with the tokens, the allgather one
    does not."""
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    x = _tokens_input(job)
    gb.seeded(job.seed)
    config = job.config(False, **unit_changes("dispatcher", job.shard))
    with torch.no_grad():
        probs, routing_map = gb.on_gpu(_router(TopKRouter, config), config)(x)[:2]
    tokens = x.detach().reshape(-1, x.shape[-1]).requires_grad_(True)
    probs = probs.detach().float().requires_grad_(True)
    with_probs = config.moe_token_dispatcher_type == "alltoall"
    out_tokens = int(routing_map.sum().item())

    def run(fused: bool) -> gb.Step:
        def permuted(t: Any) -> Any:
            out = moe_utils.permute(t, routing_map, probs=probs if with_probs else None,
                                    num_out_tokens=out_tokens, fused=fused)
            moved = out[0] if out[1] is None else out[0] * out[1].unsqueeze(-1).to(out[0].dtype)
            return moe_utils.unpermute(moved, out[2], restore_shape=t.shape, routing_map=routing_map, fused=fused)
        return _forward_backward(permuted, tokens)

    return Pair(run(False), run(True), True, f"{out_tokens} routed tokens over {job.shard.experts} experts, "
                f"{'alltoall' if with_probs else 'allgather'} dispatcher's calls")


def moe_layer(job: Job) -> Pair:
    """One MoE layer at EP 1 holding the rank's local experts, fed the tokens they take on one rank
    (the alltoall dispatcher gathers them over the expert-tensor-parallel group)."""
    s = job.shard
    x = gb.randn((s.expert_tokens // s.micro_batch, s.micro_batch, int(job.args["hidden_size"])),
                 gb.generator(job.seed), requires_grad=True)
    more = unit_changes("moe_layer", s)

    def make(config: Any) -> Any:
        return gb.build(gb.layer_spec(config).mlp, config)

    pair = _pair(job, make, lambda m: _forward_backward(lambda t: m(t), x), **more)
    pair.note = f"{job.shard.local_experts} local experts, top-{job.args.get('moe_router_topk')}"
    return pair


def attention(job: Job) -> Pair:
    """Self-attention with RoPE, as a transformer layer of the dense spec builds it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    s = job.shard
    x = gb.randn((s.seq, s.micro_batch, int(job.args["hidden_size"])), gb.generator(job.seed), requires_grad=True)
    rope = RotaryEmbedding(kv_channels=s.kv_channels, rotary_percent=float(job.args.get("rotary_percent") or 1.0),
                           rotary_base=int(job.args.get("rotary_base") or 10000))(s.seq)
    emb = (rope, rope)

    def make(config: Any) -> Any:
        return gb.build(gb.layer_spec(config).self_attention, config, layer_number=1)

    return _pair(job, make, lambda m: _forward_backward(lambda t: m(t, attention_mask=None, rotary_pos_emb=emb), x),
                 **unit_changes("attention", s))


def output_loss(job: Job) -> Pair:
    """The output layer's GEMM on the rank's vocabulary slice, then Megatron's own loss function."""
    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule

    s = job.shard
    gen = gb.generator(job.seed)
    hidden = int(job.args["hidden_size"])
    h = gb.randn((s.seq, s.micro_batch, hidden), gen, requires_grad=True)
    weight = (gb.randn((s.vocab, hidden), gen) * 0.02).requires_grad_(True)
    labels = torch.randint(0, s.vocab, (s.micro_batch, s.seq), device="cuda", generator=gen)

    def run(on: bool) -> gb.Step:
        fake = gb.fake_language_module(job.config(on, **unit_changes("output_loss", s)))

        def step() -> None:
            h.grad = weight.grad = None
            logits = torch.matmul(h, weight.t())
            loss = LanguageModule.compute_language_model_loss(fake, labels, logits)
            loss.float().mean().backward()
        return step

    return Pair(run(False), run(True), True, f"vocabulary slice {s.vocab}")


def layer_wgrad(job: Job) -> Pair:
    """One whole transformer layer of the model's spec (attention and its MLP or MoE block, the rank's
    local experts): every weight carries a main_grad buffer, as under Megatron's DDP; the stock arm
    leaves each weight gradient in .grad and adds it into main_grad afterwards, the fused arm has
    Transformer Engine accumulate it there in the GEMM."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    s = job.shard
    x = gb.randn((s.seq, s.micro_batch, int(job.args["hidden_size"])), gb.generator(job.seed), requires_grad=True)
    emb = None
    if job.args.get("position_embedding_type") == "rope":
        rope = RotaryEmbedding(kv_channels=s.kv_channels, rotary_percent=float(job.args.get("rotary_percent") or 1.0),
                               rotary_base=int(job.args.get("rotary_base") or 10000))(s.seq)
        emb = (rope, rope)

    def make(config: Any) -> Any:
        return gb.build(ModuleSpec(module=TransformerLayer, submodules=gb.layer_spec(config)), config, layer_number=1)

    more = unit_changes("layer_wgrad", s)
    return _pair(job, make, lambda m: _forward_backward(lambda t: m(t, attention_mask=None, rotary_pos_emb=emb), x),
                 **more)


def output_wgrad(job: Job) -> Pair:
    """The output layer as GPTModel builds it on the last stage: Megatron's ColumnParallelLinear from
    the hidden size to the rank's vocabulary slice, no bias, its output left split over TP (the loss
    is vocab-parallel), in the logits' dtype where this Megatron takes one. Its weight carries a
    main_grad buffer; the fused arm's weight gradient goes through what Megatron finds as APEX's
    kernel: APEX's own, or the plugin's fallback, which ``command.measure`` installed as a run of the
    plan does (nothing here installs it). Tied or untied embeddings: the same GEMM (``units``)."""
    import inspect

    from megatron.core import tensor_parallel

    s = job.shard
    hidden = int(job.args["hidden_size"])
    x = gb.randn((s.seq, s.micro_batch, hidden), gb.generator(job.seed), requires_grad=True)
    cls = tensor_parallel.ColumnParallelLinear
    extra: dict[str, Any] = {}
    if "output_dtype" in inspect.signature(cls).parameters:
        extra["output_dtype"] = gb.megatron_value(job.args.get("logit_dtype"))

    def make(config: Any) -> Any:
        return cls(hidden, s.vocab, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
                   gather_output=False, **extra)

    pair = _pair(job, make, lambda m: _forward_backward(lambda t: m(t), x), **unit_changes("output_wgrad", s))
    pair.note = f"vocabulary slice {s.vocab}; the fused arm's weight gradient by {gb.fused_wgrad_kernel()}"
    return pair


BUILDERS: dict[str, Callable[[Job], Pair]] = {
    "router": router, "dispatcher": dispatcher, "moe_layer": moe_layer, "attention": attention,
    "output_loss": output_loss, "layer_wgrad": layer_wgrad, "output_wgrad": output_wgrad,
}


def measured(job: Job, unit: str, blocks: int, warmup: int, seed: int) -> dict[str, Any]:
    """One unit built and timed for ``job``'s toggle, summarised (speedups, time saved, each arm's peak
    memory, the timings); a unit that cannot be built or run is one line, ``{"error": ...}``, so that it
    hides no other unit's result."""
    from .analysis import summarise
    from .gpu_timing import time_pair

    try:
        pair = BUILDERS[unit](job)
        timed = time_pair(pair.stock, pair.toggle, blocks, warmup, seed)
    except Exception as error:  # noqa: BLE001 (Megatron refusing a shape, or a kernel failing, is a row)
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    result = summarise(timed)
    result.update(peak_mb=timed["peak_mb"], same_weights=pair.same_weights, note=pair.note, timings=timed)
    return result
