"""Megatron-Bridge front end: the plugin's decisions on a ``ConfigContainer`` before ``pretrain``.

Bridge builds its configuration from recipes and never parses Megatron's flags nor runs its
``validate_args``, so the argparse hooks never fire. Call :func:`apply` on the container, after
the recipe and any overrides, before ``pretrain(cfg, ...)``::

    from megatron_perf_toggles import bridge
    cfg = bridge.build("megatron.bridge.recipes.llama:llama3_8b_pretrain_config")  # or your own call
    bridge.apply(cfg)
    pretrain(cfg, forward_step)

``apply`` goes through the plugin's one pipeline (``frontends/adapter.py``): the decision with the
argparse path's registry, environment, profile and guards, the start-up table and record, the
resume check and history, the cross-rank check and the safety net around Bridge's own validation.
Rules that Megatron enforces only in ``validate_args`` are applied here too, because Bridge skips
them. ``build`` calls a recipe while watching which fields it sets, so that a value the recipe
chose stays the recipe's even where it equals the dataclass default. The adapter itself is
``frontends/bridge/adapter.py``.
"""

from __future__ import annotations

from .adapter import apply, declared_default, explain, generic_declaration, read, write
from .recipe import build, traced_fields

__all__ = ["apply", "build", "declared_default", "explain", "generic_declaration", "read", "traced_fields", "write"]
