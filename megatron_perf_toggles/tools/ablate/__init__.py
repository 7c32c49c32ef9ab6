"""``megatron-perf-toggles ablate``: an experiment as a pipeline of seven stages, a module each (spec,
design, runs, schedule, execution, analysis, report; command.py calls them in order), with the
statistics they share (stats.py) and the loss test (loss/)."""
