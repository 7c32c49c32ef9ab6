"""Building each unit on the GPU from the user's Megatron arguments: Megatron's own config, specs
and modules, sized as one rank's shard, once stock and once with the toggle.

Every Megatron, torch and Transformer Engine import happens in here, inside functions: the rest of
the check plans without them. A unit is returned as a ``Step``: a callable that runs one forward and
backward of the module on fixed inputs (the same inputs for both arms, drawn once).
"""

from __future__ import annotations

import argparse
import inspect
import socket
import types
from collections.abc import Callable, Mapping
from typing import Any

Step = Callable[[], None]

# Transformer Engine spec arguments taken from the config by name where the Megatron at hand has them
SPEC_FROM_CONFIG = ("qk_l2_norm", "use_te_activation_func", "use_kitchen", "experimental_attention_variant")


def init_one_rank(seed: int) -> None:
    """torch.distributed with one rank and Megatron's model-parallel state with every size 1."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_value(value: Any) -> Any:
    """A value of the plan's recorded arguments as Megatron holds it (dtypes were recorded as text)."""
    import torch

    if isinstance(value, str) and value.startswith("torch.") and isinstance(getattr(torch, value[6:], None),
                                                                           torch.dtype):
        return getattr(torch, value[6:])
    return value


def config_for(args: Mapping[str, Any], **changes: Any) -> Any:
    """Megatron's TransformerConfig for the shard's arguments with ``changes`` (the arm's toggle)."""
    from megatron.training.arguments import core_transformer_config_from_args

    ns = argparse.Namespace(**{k: megatron_value(v) for k, v in args.items()})
    for name, value in changes.items():
        setattr(ns, name, value)
    return core_transformer_config_from_args(ns)


def layer_spec(config: Any) -> Any:
    """The Transformer Engine layer submodules pretrain_gpt builds for this config. Newer cores wrap
    the submodules' builder in a ``*args, **kwargs`` spec function: its own signature is read then."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    submodules = getattr(specs, "get_gpt_layer_with_transformer_engine_submodules", None)
    build = submodules or specs.get_gpt_layer_with_transformer_engine_spec
    accepted = inspect.signature(build).parameters
    kwargs = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": config.moe_grouped_gemm,
              "qk_layernorm": config.qk_layernorm, "multi_latent_attention": config.multi_latent_attention}
    kwargs.update({name: getattr(config, name) for name in SPEC_FROM_CONFIG if hasattr(config, name)})
    built = build(**{k: v for k, v in kwargs.items() if k in accepted})
    return built if submodules else built.submodules


def build(spec: Any, config: Any, **extra: Any) -> Any:
    """A submodule from its spec as the layer builds it: a ``ModuleSpec`` through Megatron's
    ``build_module``, a builder (newer cores' ``partial``) by calling it; either way with the
    process groups where the module takes them (one rank's here)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(spec, ModuleSpec):
        target = spec.module if isinstance(spec.module, type) else None
        accepted = inspect.signature(target).parameters if target is not None else {}
        return build_module(spec, config=config, **extra, **groups_for(accepted))
    accepted = inspect.signature(spec).parameters
    extra.update(groups_for(accepted))
    if "is_mtp_layer" in accepted:
        extra["is_mtp_layer"] = False
    return spec(config=config, **extra)


def groups_for(accepted: Mapping[str, Any]) -> dict[str, Any]:
    """``pg_collection`` where the module takes it: Megatron's model-parallel groups (one rank)."""
    if "pg_collection" not in accepted:
        return {}
    from megatron.core.process_groups_config import ProcessGroupCollection

    return {"pg_collection": ProcessGroupCollection.use_mpu_process_groups()}


def with_main_grads(module: Any, step: Step, bf16: bool) -> Step:
    """The step as Megatron's DDP runs it: every parameter has a main_grad buffer (fp32, or bf16 where
    the plan reduces in bf16); after backward, what a parameter's gradient left in .grad is added into
    it (with gradient accumulation fusion, Transformer Engine has already accumulated there)."""
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    dtype = torch.bfloat16 if bf16 else torch.float32
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=dtype, device=p.device)

    def ddp_step() -> None:
        step()
        for p in params:
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None
    return ddp_step


def fused_wgrad_kernel() -> str:
    """What Megatron's own linear layers call for a fused weight gradient in this process, for the
    record: APEX's kernel, the plugin's torch fallback, or none (Megatron then refuses the fused arm)."""
    from megatron.core.tensor_parallel import layers

    from ...runtime.wgrad_fallback import is_fallback

    kernel = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    if kernel is None or not getattr(layers, "_grad_accum_fusion_available", False):
        return "no kernel (APEX's fused_weight_gradient_mlp_cuda is missing and the fallback is not installed)"
    return "the plugin's torch fallback" if is_fallback(kernel) else "APEX's fused_weight_gradient_mlp_cuda"


def on_gpu(module: Any, config: Any) -> Any:
    """The module as training holds it: on the GPU in the run's 16-bit type (Megatron's Float16Module
    casts the same way), or as built for fp32 runs."""
    module = module.cuda()
    if getattr(config, "bf16", False):
        return module.bfloat16()
    return module.half() if getattr(config, "fp16", False) else module


def seeded(seed: int) -> None:
    """The same random state before each arm's build, so same-shaped weights come out equal."""
    import torch
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def same_weights(stock: Any, toggle: Any) -> bool:
    """Copy the stock module's weights into the toggle's where the two have the same layout."""
    a, b = stock.state_dict(), toggle.state_dict()
    if a.keys() != b.keys() or any(hasattr(a[k], "shape") and a[k].shape != b[k].shape for k in a):
        return False
    toggle.load_state_dict(a)
    return True


def randn(shape: tuple[int, ...], gen: Any, requires_grad: bool = False) -> Any:
    import torch

    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x.requires_grad_(requires_grad)


def generator(seed: int) -> Any:
    import torch

    return torch.Generator(device="cuda").manual_seed(seed)


def fake_language_module(config: Any) -> Any:
    """What Megatron's ``LanguageModule.compute_language_model_loss`` reads of its module: the config and
    the tensor-parallel group (one rank here)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    return types.SimpleNamespace(config=config, pg_collection=types.SimpleNamespace(tp=tp), tp_group=tp)
