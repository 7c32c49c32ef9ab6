"""Inside the training process: register the flags on Megatron's parser, probe the machine, apply
the plan and own every process-wide patch that applying it needs. Imports ``core`` and ``errors``.
"""
