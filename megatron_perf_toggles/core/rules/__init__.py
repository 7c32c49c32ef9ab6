"""Megatron's rules as data, and the guards that answer them.

``megatron_rules.py`` (with its MoE and allocator parts) declares what Megatron asserts or changes,
version by version; the guard modules declare, beside each check, the toggles a guard may move and
the rules it answers; ``guards.py`` puts them in the order they run. A rule and its answer live in
one folder because each names the other.
"""
