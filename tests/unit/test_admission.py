"""The admission gate: every default-on toggle of the registry has a record that earns its place
(speed alone, not slower; loss equivalent within the stated margin, or not measurable here with a
reason), and the checker refuses planted bad records."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import REPO

from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.tools import admission
from megatron_perf_toggles.tools.ablate.spec import ExperimentSpec

RAW = "docs/benchmarks/raw/admission-test.json"


def test_the_toggles_that_need_a_record_come_from_the_registry():
    on = [t for t in TOGGLES if t.kind == "bool" and t.default is True]
    assert admission.default_on() == (*(t.dest for t in on), "defaults")
    assert on, "the registry turns some toggle on by default"


def test_the_stated_margin_is_ablate_s_default():
    assert admission.STATED_MARGIN_PCT == ExperimentSpec().loss_margin


def _speed(estimate=1.05, low=1.01, high=1.09, verdict="faster"):
    return {"shape": "small MoE", "estimate": estimate, "low": low, "high": high, "verdict": verdict, "blocks": 5}


def _paired(diff=0.1, low=-0.3, high=0.5, margin=1.0, verdict="equivalent within +-1 %", seeds=70):
    return {"kind": "paired", "difference_pct": diff, "low_pct": low, "high_pct": high, "margin_pct": margin,
            "verdict": verdict, "seeds": seeds}


def _record(loss=None, **more):
    out = {"speed": {"alone": [_speed()]}, "loss": loss or _paired(),
           "versions": {"megatron": "0.20.0", "transformer_engine": "2.20", "torch": "2.11", "gpu": "NVIDIA H200"},
           "data": [RAW], "covers": "one H200, bf16"}
    return {**out, **more}


def _good():
    records = {name: _record() for name in admission.default_on()}
    records["cross_entropy_loss_fusion"] = _record({"kind": "numerics+defaults",
                                                    "numerics": {"passed": True, "detail": "loss and grads"}})
    records["ddp_average_in_collective"] = _record({"kind": "not measurable here",
                                                    "reason": "on one GPU averaging in the collective does nothing"})
    return {"format": admission.FORMAT, "schema": 1, "records": records}


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "docs" / "benchmarks" / "raw").mkdir(parents=True)
    (tmp_path / RAW).write_text("{}")
    return tmp_path


def test_a_complete_file_admits_every_toggle(repo, capsys):
    assert not any(admission.check(_good(), repo).values())
    path = repo / "docs" / "benchmarks" / "admission.json"
    path.write_text(json.dumps(_good()))
    assert admission.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(admission.default_on())
    # a loss that cannot be measured here passes the gate, but the line says provisional
    provisional = [line for line in out if ": admitted: " not in line]
    assert len(provisional) == 1 and provisional[0].startswith("ddp_average_in_collective: PROVISIONAL")
    assert "not measurable here (on one GPU" in provisional[0]


def _planted(edit):
    data = _good()
    edit(data["records"])
    return data


BAD = {
    "a default-on toggle without a record": (lambda r: r.pop("moe_router_fusion"), "moe_router_fusion", "no record"),
    "the defaults without a record": (lambda r: r.pop("defaults"), "defaults", "no record"),
    "slower alone": (lambda r: r["moe_permute_fusion"]["speed"].update(alone=[_speed(0.89, 0.85, 0.93, "slower")]),
                     "moe_permute_fusion", "slower"),
    "slower together": (lambda r: r["moe_permute_fusion"]["speed"].update(together=[_speed(0.97, 0.95, 0.99, "-")]),
                        "moe_permute_fusion", "slower"),
    "slower where it acts": (lambda r: r["moe_permute_fusion"]["speed"].update(layer=[
        {**_speed(0.70, 0.66, 0.74, "slower"), "unit": "dispatcher", "clock": "wall"}]), "moe_permute_fusion", "slower"),
    "no speed alone": (lambda r: r["grad_reduce_in_bf16"].update(speed={}), "grad_reduce_in_bf16", "no measurement"),
    "worse": (lambda r: r["grad_reduce_in_bf16"].update(loss=_paired(2.0, 1.5, 2.5, verdict="different: worse")),
              "grad_reduce_in_bf16", "loss: worse"),
    "inconclusive": (lambda r: r["grad_reduce_in_bf16"].update(loss=_paired(0.0, -2.0, 2.0, verdict="inconclusive")),
                     "grad_reduce_in_bf16", "loss: inconclusive"),
    "a wider margin": (lambda r: r["moe_grouped_gemm"].update(loss=_paired(
        0.1, -1.2, 1.3, margin=1.5, verdict="equivalent within +-1.5 %")), "moe_grouped_gemm", "wider than the stated"),
    "an interval outside its margin": (lambda r: r["moe_grouped_gemm"].update(loss=_paired(0.5, -0.2, 1.2)),
                                       "moe_grouped_gemm", "not inside"),
    "not measurable without a reason": (lambda r: r["ddp_average_in_collective"].update(
        loss={"kind": "not measurable here", "reason": " "}), "ddp_average_in_collective", "without a reason"),
    "numerics without a passed check": (lambda r: r["cross_entropy_loss_fusion"]["loss"].update(
        numerics={"passed": False}), "cross_entropy_loss_fusion", "no passed numerics"),
    "numerics with the defaults inconclusive": (lambda r: r["defaults"].update(
        loss=_paired(0.0, -2.0, 2.0, verdict="inconclusive")), "cross_entropy_loss_fusion", "defaults record"),
    "no versions": (lambda r: r["defaults"].update(versions={"megatron": "0.20.0"}), "defaults", "versions: no"),
    "data outside raw": (lambda r: r["defaults"].update(data=["results.json"]), "defaults", "not under"),
    "data that is missing": (lambda r: r["defaults"].update(data=["docs/benchmarks/raw/none.json"]), "defaults",
                             "does not exist"),
    "nothing said about what it covers": (lambda r: r["defaults"].update(covers=""), "defaults", "covers"),
    "a record for a name that is no default": (lambda r: r.update(moe_grouped_gem=_record()), "moe_grouped_gem",
                                               "not a default-on toggle"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_planted_bad_records_are_refused(repo, case):
    edit, name, words = BAD[case]
    found = admission.check(_planted(edit), repo)
    assert any(words in p for p in found[name]), found[name]
    others = {n: p for n, p in found.items() if p and n != name}
    # only the planted record fails (a defaults record that fails also fails the numerics record that leans on it)
    leaning = {"defaults", "cross_entropy_loss_fusion"} if found["defaults"] else set()
    assert not set(others) - leaning, others


def test_a_file_of_another_format_and_an_unreadable_file(tmp_path, capsys):
    assert admission.check({"records": {}}) == {"file": ["format is None, expected 'megatron-perf-toggles/admission'"]}
    assert "file" in admission.check([])  # type: ignore[arg-type]
    path = tmp_path / "a.json"
    path.write_text("{")
    assert admission.main([str(path)]) == 2 and "not a readable admission file" in capsys.readouterr().err
    assert admission.main(["--x"]) == 2
    bad = copy.deepcopy(_good())
    bad["records"].pop("defaults")
    path.write_text(json.dumps(bad))
    assert admission.main([str(path)]) == 1
    assert "defaults: NOT ADMITTED: no record" in capsys.readouterr().out


def test_every_default_on_toggle_has_an_admission_record():
    """The repository's own record file. It fails until the GPU measurements are written into it."""
    path = REPO / "docs" / "benchmarks" / "admission.json"
    found = admission.check(json.loads(path.read_text()), REPO)
    assert not {n: p for n, p in found.items() if p}, "\n".join(
        admission.summary_line(n, None, p) for n, p in found.items() if p)


def test_a_speed_interval_that_resolves_nothing_is_provisional_not_admitted():
    wide = {"shape": "s", "estimate": 1.4, "low": 0.15, "high": 14.9, "verdict": "no detectable difference", "blocks": 2}
    tight = {"shape": "t", "estimate": 1.0, "low": 0.99, "high": 1.01, "verdict": "no detectable difference", "blocks": 3}
    record = {"speed": {"alone": [tight, wide]}, "loss": {"kind": "not measurable here", "reason": "r"}}
    line = admission.summary_line("x", record, [])
    assert line.startswith("x: PROVISIONAL") and "not resolved: s" in line and "t;" not in line
    record["speed"]["alone"] = [tight]
    # a loss that cannot be measured here keeps the toggle, but not as admitted
    assert admission.summary_line("x", record, []).startswith("x: PROVISIONAL (not resolved: loss")
    record["loss"] = {"kind": "paired", "difference_pct": 0.1, "low_pct": -0.2, "high_pct": 0.3, "verdict": "equivalent",
                      "seeds": 16}
    assert admission.summary_line("x", record, []).startswith("x: admitted")


def test_a_resolved_layer_entry_admits_a_toggle_the_whole_run_cannot_resolve(repo, capsys):
    data = _good()
    record = data["records"]["moe_router_fusion"]
    record["speed"]["alone"] = [_speed(0.997, 0.716, 1.389, "no detectable difference")]
    path = repo / "docs" / "benchmarks" / "admission.json"
    path.write_text(json.dumps(data))
    admission.main([str(path)])
    assert "moe_router_fusion: PROVISIONAL" in capsys.readouterr().out
    record["speed"]["layer"] = [{**_speed(1.744, 1.681, 1.809), "unit": "router", "clock": "gpu", "shape": "other"}]
    path.write_text(json.dumps(data))
    admission.main([str(path)])
    assert "moe_router_fusion: PROVISIONAL" in capsys.readouterr().out  # resolved on another shape only
    record["speed"]["layer"] = [{**_speed(1.744, 1.681, 1.809), "unit": "router", "clock": "gpu"}]
    path.write_text(json.dumps(data))
    assert admission.main([str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("moe_router_fusion"))
    assert line.startswith("moe_router_fusion: admitted") and "where it acts (router): gpu x1.744" in line
