"""Reaching Megatron's own parse path without editing Megatron: the parse hooks, the dry-run
report, the import stand-ins, and ``python -m megatron_perf_toggles.run``. Imports ``runtime`` and below.
"""
