"""``python -m megatron_perf_toggles.run SCRIPT ...``: the launcher, under the name users type.

The launcher itself lives in ``launcher.launch``, named as a front end by
``frontends.megatron_launcher``; this module only keeps the documented command (and
``torchrun -m megatron_perf_toggles.run``) working.
"""

from __future__ import annotations

from .frontends.megatron_launcher import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
