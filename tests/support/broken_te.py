"""A Transformer Engine installed but broken, as a plain ``pip install transformer-engine`` leaves it.

PyPI's ``transformer-engine`` alone is a meta package: its ``transformer_engine`` package is there,
and its import raises ``RuntimeError: Found empty `transformer-engine` meta package installed ...``
because no framework extension came with it. :func:`meta_package` lays out the same in a folder
to put first on ``sys.path`` (the package whose ``__init__`` raises, and its distribution record);
:func:`dist_only` lays out the record with no module at all.
"""

from __future__ import annotations

from pathlib import Path

VERSION = "2.8.0"
MESSAGE = ("Found empty `transformer-engine` meta package installed. Install `transformer-engine` with "
           "framework extensions")


def dist_only(where: Path) -> Path:
    """``where`` holding a ``transformer_engine`` distribution record and no module."""
    info = where / f"transformer_engine-{VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {VERSION}\n")
    (info / "RECORD").write_text("")
    return where


def meta_package(where: Path) -> Path:
    """``where`` holding the meta package as installed: a ``transformer_engine`` package whose import
    raises as the real one does, and its distribution record."""
    dist_only(where)
    package = where / "transformer_engine"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f"raise RuntimeError({MESSAGE!r})\n")
    return where
