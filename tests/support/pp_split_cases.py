"""Each pipeline rank's layers, as Megatron builds them and as the memory model reads them (kind
``pp_split``), run on a tree's worker (tree_driver.py) for tests/real/test_pipeline_split_real.py.

A case is a command line on top of ``parse_cases.COMMON``. Stock Megatron parses it (no plugin),
validates it and builds its TransformerConfig; then, for each pipeline rank and virtual stage, the
tree's own ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` say which layers that
chunk builds (the pipeline rank and the virtual size set as Megatron's parallel state would hold
them, no process group needed). The plugin's pure ``rank_layers`` reads the namespace as parsed,
before validate_args, which is where the plugin plans. Both answers go back to the test.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import parse_cases
from sandbox import sandbox_os_environ

# Megatron's parallel state that the layer counts read: put back after every case.
_STATE = ("_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
          "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE")


def _megatron_split(config: Any) -> list[list[int]]:
    """Each pipeline rank's layers, from the tree's own functions."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
    out = []
    for rank in range(pp):
        parallel_state.set_pipeline_model_parallel_rank(rank)
        layers: list[int] = []
        for chunk in range(vp or 1):
            stage = chunk if vp else None
            first = get_transformer_layer_offset(config, vp_stage=stage)
            layers.extend(range(first, first + get_num_layers_to_build(config, vp_stage=stage)))
        out.append(layers)
    return out


@contextlib.contextmanager
def _rank_zero() -> Iterator[None]:
    """Without a process group, answer torch.distributed's rank as rank 0 of a launch would (core
    0.13 prints a parsed pipeline layout from rank 0 while building the TransformerConfig)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    real = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = real


def run_case(case: dict) -> dict:
    """One case in the worker, Megatron imported from the tree on its path."""
    from megatron_perf_toggles.core.memory.pipeline_split import SplitUnknown, rank_layers
    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    with megatron_importable():
        from megatron.core import parallel_state
        from megatron.training import arguments
    saved_environ, saved_argv = dict(os.environ), list(sys.argv)
    saved_state = {name: getattr(parallel_state, name, None) for name in _STATE}
    result: dict[str, Any] = {"id": case["id"]}
    out, err = io.StringIO(), io.StringIO()
    try:
        sandbox_os_environ(extra={"WORLD_SIZE": str(case["world"])}, drop=("RANK", "LOCAL_RANK"))
        sys.argv = ["pretrain_gpt.py", *parse_cases.COMMON, *case["argv"]]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = arguments.parse_args()
            parsed = dict(vars(args))
            try:
                split = rank_layers(parsed, args.num_layers, args.pipeline_model_parallel_size)
                result["plugin"] = [list(rank) for rank in split]
            except SplitUnknown as why:
                result["plugin_unknown"] = str(why)
            try:
                arguments.validate_args(args, {})
                with _rank_zero():
                    config = arguments.core_transformer_config_from_args(args)
            except (AssertionError, ValueError) as refused:
                result["megatron_refused"] = f"{type(refused).__name__}: {refused}"
                return result
            result["megatron"] = _megatron_split(config)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback_tail"] = traceback.format_exc().splitlines()[-4:]
        result["stderr"] = err.getvalue()[-2000:]
    finally:
        for name, value in saved_state.items():
            setattr(parallel_state, name, value)
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv = saved_argv
    return result
