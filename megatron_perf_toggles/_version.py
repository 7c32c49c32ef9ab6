"""The package version, in a module of its own so that any layer can read it without importing
the package's ``__init__`` (which imports the runtime)."""

__version__ = "0.2.0"
