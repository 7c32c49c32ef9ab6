"""Megatron's argparse surface as JSON facts: recorded from real trees, replayed as parsers for planning."""
