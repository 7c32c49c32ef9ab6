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


# --- a Transformer Engine installed here that cannot serve a plan -----------------------------------


@pytest.fixture
def te_here(tmp_path, monkeypatch):
    """Lays out a Transformer Engine on sys.path (broken_te's forms, or a working one) and forgets
    every transformer_engine module afterwards."""
    import importlib

    import broken_te

    def lay_out(kind: str):
        where = tmp_path / kind
        if kind == "working":
            (where / "transformer_engine").mkdir(parents=True)
            (where / "transformer_engine" / "__init__.py").write_text("__version__ = '9.9.0'\n")
        else:
            getattr(broken_te, kind)(where)
        monkeypatch.syspath_prepend(str(where))
        importlib.invalidate_caches()
        return where

    for name in [n for n in sys.modules if n.partition(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
        monkeypatch.delitem(sys.modules, name)
    yield lay_out
    for name in [n for n in sys.modules if n.partition(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
        del sys.modules[name]


@pytest.mark.parametrize("kind", ["meta_package", "dist_only"])
@pytest.mark.parametrize("elsewhere", [True, False])
def test_a_te_that_does_not_import_is_stood_in_for(te_here, kind, elsewhere):
    """``pip install transformer-engine`` alone leaves a meta package whose import raises: planning a
    recipe refused ("Found empty `transformer-engine` meta package installed"). The stand-in serves
    instead, for this machine's plan and another's alike."""
    te_here(kind)
    with pytest.raises((RuntimeError, ImportError)):
        __import__("transformer_engine.pytorch")
    with te_standin.transformer_engine(elsewhere) as placed:
        import transformer_engine.pytorch as te_pytorch
        import transformer_engine_torch

        assert placed and te_pytorch.__version__ == te_standin.VERSION and transformer_engine_torch is not None
    assert not any(isinstance(f, te_standin._Finder) for f in sys.meta_path)  # only for the plan


def test_another_machines_plan_never_rests_on_this_machines_te(te_here):
    """A working TE installed here serves a plan for this machine; one for another machine gets the
    stand-in, and the TE already imported here is back once the plan is done."""
    te_here("working")
    import transformer_engine

    assert transformer_engine.__version__ == "9.9.0"
    with te_standin.transformer_engine(elsewhere=False) as placed:
        assert not placed and __import__("transformer_engine").__version__ == "9.9.0"
    with te_standin.transformer_engine(elsewhere=True) as placed:
        assert placed and __import__("transformer_engine").__version__ == te_standin.VERSION
    assert sys.modules["transformer_engine"] is transformer_engine


def test_megatron_sees_no_te_where_the_one_here_does_not_import_in_another_machines_plan(te_here):
    """The launcher's dry run, explain --megatron and a Primus file on a checkout import Megatron,
    which imports TE where installed: for another machine's plan, a TE that does not import is
    taken as absent (ModuleNotFoundError, which Megatron's own import guards expect)."""
    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    te_here("meta_package")
    with megatron_importable(elsewhere=True), pytest.raises(ModuleNotFoundError, match="does not import here"):
        __import__("transformer_engine")
    with megatron_importable(elsewhere=False), pytest.raises(RuntimeError, match="meta package"):
        __import__("transformer_engine")  # this machine's plan: as this machine would run it


def test_doctor_says_an_installed_te_does_not_import(te_here):
    from megatron_perf_toggles.runtime.machine.capabilities import TE_BROKEN, detect

    te_here("meta_package")
    caps = detect(deep=True)
    assert caps.te_version is None and not caps.te_cross_entropy
    assert TE_BROKEN in caps.notes["te"] and "Found empty `transformer-engine` meta package" in caps.notes["te"]
