"""Offline tools around the plugin: the ``megatron-perf-toggles`` command, ablations, recorded
Megatron surfaces, the patch sets and the README tables. Imports any layer below; none imports it.
"""
