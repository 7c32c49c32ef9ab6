"""The loss test of an experiment: paired equivalence over seeds (``equivalence``), each arm's test
against the baseline (``loss_test``, part of the analysis; report.py words it), and the one saved
state every arm of a seed may start from (``common_start``, part of the runs)."""
