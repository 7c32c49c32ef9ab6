"""``from megatron_perf_toggles.hooks import install_from_argv``: what a patched ``pretrain_gpt.py`` runs.

The patches in ``patches/`` (and every checkout they were already applied to) import this name;
the hooks themselves live in ``launcher.megatron_hooks``.
"""

from __future__ import annotations

from .launcher.megatron_hooks import install_from_argv

__all__ = ["install_from_argv"]
