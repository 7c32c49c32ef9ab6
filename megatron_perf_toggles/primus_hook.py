"""Turn the Primus front end on from a ``.pth`` file, under the name the ``.pth`` line imports::

    import megatron_perf_toggles.primus_hook

The hook lives in ``frontends/primus/hook.py``: importing it installs an import hook that registers
the plugin's patches when (and if) Primus imports its patch registry; nothing else is imported.
"""

from __future__ import annotations

import sys

from .frontends.primus import hook as _module
from .frontends.primus.hook import TARGET, install

__all__ = ["TARGET", "install"]

# One module under both names: what users set on megatron_perf_toggles.primus_hook (a patched function,
# a replaced hook) is what the front end itself uses.
sys.modules[__name__] = _module
