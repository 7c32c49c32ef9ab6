"""The loss test of an experiment: paired equivalence over seeds (``equivalence``), its rows and
verdict lines (``loss_test``), and the one saved state every arm of a seed may start from
(``common_start``)."""
