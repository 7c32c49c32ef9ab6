"""The Transformer Engine stand-in's one ordering concern: NVIDIA ModelOpt imported before it, only for
the Megatron-Bridge releases that import ModelOpt at module level (0.4 and 0.5)."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from megatron_perf_toggles.frontends import te_standin


@pytest.mark.parametrize(("bridge", "imported"), [("0.4.2", True), ("0.5.1", True), ("0.6.2", False),
                                                  ("0.7.0rc1", False), (None, False)])
def test_modelopt_is_imported_first_only_for_bridge_0_4_and_0_5(monkeypatch, bridge, imported):
    def version(name: str) -> str:
        if name != "megatron-bridge" or bridge is None:
            raise metadata.PackageNotFoundError(name)
        return bridge

    asked: list[str] = []
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(te_standin, "installed", lambda name: name == "modelopt")
    monkeypatch.setattr(te_standin.importlib, "import_module", lambda name: asked.append(name))
    monkeypatch.delitem(sys.modules, "modelopt", raising=False)
    te_standin.modelopt_first()
    assert asked == (["modelopt.torch.quantization"] if imported else [])


def test_a_modelopt_that_fails_to_import_is_left_alone(monkeypatch):
    def broken(name: str) -> None:
        raise ModuleNotFoundError("No module named 'scipy'")

    monkeypatch.setattr(te_standin, "_bridge_release", lambda: (0, 5))
    monkeypatch.setattr(te_standin, "installed", lambda name: name == "modelopt")
    monkeypatch.setattr(te_standin.importlib, "import_module", broken)
    monkeypatch.delitem(sys.modules, "modelopt", raising=False)
    te_standin.modelopt_first()  # no exception: the plan goes on, and Bridge says what it lacks
