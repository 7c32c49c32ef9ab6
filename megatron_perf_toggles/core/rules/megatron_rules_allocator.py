"""Megatron-LM's rules about PyTorch's allocator setting (``PYTORCH_CUDA_ALLOC_CONF``), which the
memory plan may ask a launch to export (core.memory.allocator): declared like the toggles' rules, detected
the same way, and part of ``megatron_rules.RULES``. Pure data."""

from __future__ import annotations

from .megatron_rule import MegatronRule

ALLOCATOR_RULES: tuple[MegatronRule, ...] = (
    MegatronRule(
        'nccl_ub_expandable_segments', (),
        ('megatron/core/distributed/distributed_data_parallel_config.py',),
        "expandable_segments:True' in os.getenv('PYTORCH_CUDA_ALLOC_CONF'", 'config',
        ('0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'NCCL user buffers (--use-nccl-ub) refuse PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True',
        'plan: expandable segments are never listed for such a layout; the memory plan says why',
    ),
    MegatronRule(
        'nccl_ub_expandable_segments_torch', (),
        ('megatron/core/distributed/distributed_data_parallel_config.py',),
        'self.nccl_ub and not is_torch_min_version("2.11.0a0")', 'config',
        ('0.18.0', '0.18.2', '0.19.0', 'main'),
        'the NCCL user-buffer refusal of expandable segments applies only before torch 2.11',
        'plan: with torch 2.11 or later (known) expandable segments may be listed',
    ),
    MegatronRule(
        'cuda_graphs_expandable_segments', (),
        ('megatron/training/arguments.py',),
        'expandable_segments:True may not be safe when using CUDA Graphs', 'validate',
        ('0.14.0', '0.15.0'),
        'CUDA graphs (0.14: external ones) assert expandable segments are off',
        'plan: expandable segments are never listed with CUDA graphs there; the memory plan says why',
    ),
    MegatronRule(
        'te_cuda_graphs_nccl_graph_register', (),
        ('megatron/training/arguments.py',),
        'or os.getenv("NCCL_GRAPH_REGISTER", "") == "0"', 'validate',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        "Transformer Engine's CUDA graphs with expandable segments assert NCCL_GRAPH_REGISTER=0",
        'plan: NCCL_GRAPH_REGISTER=0 is listed beside expandable segments',
    ),
)
