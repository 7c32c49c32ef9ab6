"""``megatron-perf-toggles ablate``: experiment designs, the runner, its statistics and the log parser."""
