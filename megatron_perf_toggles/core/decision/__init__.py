"""The decision: precedence, FP4 layer selection and the resolution that applies the guards.

``decide.py`` is the entry point (``decide``, ``Plan``, ``Decision``, ...); ``plan.py`` holds the
records a decision is made of, ``resolve.py`` precedence and resolution, ``fp4.py`` FP4 selection.
Kept apart from the rules it applies (``core/rules``) so that each folder reads in one sitting.
"""
