"""``from megatron_perf_toggles.hooks import install_from_argv``: what a patched ``pretrain_gpt.py`` runs.

``prepare_from_argv`` runs first, above the script's own imports: it checks what the user set and,
for a dry run, puts the import stand-ins in place, before anything of Megatron's is imported.

The patches in ``patches/`` (and every checkout they were already applied to) import this name;
the hooks themselves live in ``launcher.parse_hooks``, named as a front end by
``frontends.megatron_parser``.
"""

from __future__ import annotations

from .frontends.megatron_parser import install_from_argv, prepare_from_argv

__all__ = ["install_from_argv", "prepare_from_argv"]
