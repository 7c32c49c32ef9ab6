"""The policy: what each toggle is, what the environment asks for, and what the guards decide.

Pure: no I/O, no torch or Megatron import. Imports only ``errors`` from outside this package.
"""
