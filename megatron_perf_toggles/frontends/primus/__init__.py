"""The Primus front end, in one folder: its adapter (``adapter.py``), Primus's ``validate_args``
with a refusal's stop and the safety net (``validate.py``), a Primus file planned on a recorded
surface (``offline.py``), the patches registered with Primus (``public.py``, which the package
top names ``megatron_perf_toggles.primus``) and the ``.pth`` import hook (``hook.py``, named
``megatron_perf_toggles.primus_hook``).

Nothing is imported here: the ``.pth`` hook runs in every interpreter of an environment and must
load only itself.
"""
