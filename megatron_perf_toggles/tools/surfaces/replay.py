"""The recorded-surface replay under its historical name: the module is ``runtime/surface_replay.py``
(the front ends plan on recorded surfaces too, below the tools)."""

import sys

from ...runtime import surface_replay

sys.modules[__name__] = surface_replay
