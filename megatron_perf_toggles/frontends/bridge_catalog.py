"""``python -m megatron_perf_toggles.frontends.bridge_catalog``: the recorder's command as the docs
and recorded catalogs name it.

The catalog lives in ``frontends/bridge/catalog.py`` with the rest of the Bridge front end; this
module keeps the documented command (and ``from megatron_perf_toggles.frontends import
bridge_catalog``) working and holds nothing of its own.
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    # Run as the command: the catalog's own ``__main__`` block (offline Hugging Face, exit status).
    runpy.run_module(f"{__package__}.bridge.catalog", run_name="__main__", alter_sys=True)
else:
    from .bridge import catalog as _module

    # One module under both names, as the package top's front-end names are.
    sys.modules[__name__] = _module
