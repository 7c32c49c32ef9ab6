"""The Megatron-Bridge front end, in one folder: its adapter (``adapter.py``), the recipe traced
while it builds (``recipe.py``), the safety net around Bridge's validation (``net.py``), what
``cfg.comm_overlap`` carries (``comm_overlap.py``), the recorded recipe catalog for planning
without Bridge (``catalog.py``) and the public face (``public.py``, which the package top names
``megatron_perf_toggles.bridge``).

Nothing is imported here, so that a module of the folder loads only what it needs.
"""
