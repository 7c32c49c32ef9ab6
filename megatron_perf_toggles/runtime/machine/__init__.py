"""The machine a plan is for: this one, detected, or the planned one of a dry run.

``capabilities.py`` answers the registry's capabilities (with ``probe.py`` for "is it installed",
"which torch" and "can a GPU be visible here", and ``assume.py`` for
``MEGATRON_PERF_TOGGLES_ASSUME``); ``target.py`` is the planned world and GPU of a dry run.
"""
