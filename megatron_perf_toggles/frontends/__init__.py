"""The config front ends: frameworks that build Megatron's arguments their own way (Megatron-Bridge,
Primus) and so never run the argparse path the provider and the launcher hook into.

``adapter.py`` is what every front end shares (start a context, read, plan through the one pipeline,
write back); each framework has a folder of its own (``bridge/``, ``primus/``) with its adapter, its
own validation watched by the safety net, and its public face (``bridge/public.py``,
``primus/public.py``, ``primus/hook.py``; the package top re-exports them under the names users
import). ``explain.py`` plans a Bridge recipe or a Primus file for ``explain``, with
``te_standin.py`` standing in for Transformer Engine where it is missing.
"""
