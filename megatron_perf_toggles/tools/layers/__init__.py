"""The layer-level check: each toggle timed where it acts, on one GPU, against stock.

``megatron-perf-toggles layers -- <Megatron arguments>`` plans the user's command line as the
launcher's dry run does, then builds, for each default-on toggle of that plan, the module it acts on
(``units``), once stock and once with the toggle, sized as one rank of the user's layout holds it
(``shard``), and times forward and backward of both in one process with the arms interleaved
(``gpu_timing``). ``analysis`` turns the per-block times into a speedup with its interval (the
statistics of ``ablate``) and the share of a training step; ``report`` prints and records it.
Without a GPU (or with ``--check``) it stops after the plan and says what it would build.
"""
