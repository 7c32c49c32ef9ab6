"""The admission gate: every toggle the plugin turns on by default has a record that earns it.

A default is a promise to users: faster where it is on, and training unchanged. The record file
(``docs/benchmarks/admission.json``) holds, per default-on toggle of the registry and for the
defaults together, the measurements that keep that promise: speed alone (and together where
measured) with intervals, the loss test (the toggle's own paired test within the margin; for a
fusion that should be exact math, the numerics check passed plus the defaults-together test
within the margin; or "not measurable here" with the reason), the versions measured on, the raw
data files and what the record covers. This module checks the file; the list of toggles is
derived from the registry, so a new default-on toggle without a record fails the check.

    python -m megatron_perf_toggles.tools.admission [PATH]      # one line per toggle; exit 1 if any fails

File format (JSON)::

    {"format": "megatron-perf-toggles/admission", "schema": 1,
     "records": {"<toggle dest or 'defaults'>": {
        "speed": {"alone": [{"shape": str, "estimate": x, "low": x, "high": x, "verdict": str, "blocks": n}, ...],
                  "together": [... the same, optional],
                  "layer": [... the same, with "unit" and "clock" (gpu | wall): measured where the toggle
                            acts by ``megatron-perf-toggles layers``, on shapes where the plan has it on]},
        "loss": {"kind": "paired" | "numerics+defaults" | "not measurable here",
                 "difference_pct": x, "low_pct": x, "high_pct": x, "margin_pct": x, "verdict": str, "seeds": n,
                 "numerics": {"passed": true, "detail": str}    (numerics+defaults only),
                 "reason": str                                  (not measurable here only)},
        "versions": {"megatron": str, "transformer_engine": str, "torch": str, "gpu": str},
        "data": ["docs/benchmarks/raw/...", ...],
        "covers": str}}}

Speed figures are speedups (baseline time / arm time: above 1 is faster); loss figures are in % of
the baseline's loss, as ``ablate``'s loss test gives them. A toggle's "alone" is the toggle alone
against stock (``ablate --design each-alone``'s ``only:`` arms); the defaults record's is every
default together against stock, and it needs a paired loss test of its own, since the
"numerics+defaults" records lean on it. A toggle's "layer" entries are its effect where it acts
(its unit, one GPU, arms interleaved in one process): none may be slower, on either clock; where the
whole run cannot resolve a few-% effect, a resolved faster layer entry is what admits it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.registry import TOGGLES

FORMAT = "megatron-perf-toggles/admission"
DEFAULT_PATH = Path("docs") / "benchmarks" / "admission.json"
RAW_DIR = "docs/benchmarks/raw/"
STATED_MARGIN_PCT = 1.0  # the margin every loss claim must meet: ablate's default --loss-margin
DEFAULTS = "defaults"
LOSS_KINDS = ("paired", "numerics+defaults", "not measurable here")
VERSION_KEYS = ("megatron", "transformer_engine", "torch", "gpu")


def default_on() -> tuple[str, ...]:
    """The toggles the plugin turns on by default (from the registry), then the defaults together.
    On/off toggles only: a choice between implementations (``cross_entropy_fusion_impl``) is part
    of its toggle's record and of the defaults together, not a record of its own."""
    return (*(t.dest for t in TOGGLES if t.kind == "bool" and t.default is True), DEFAULTS)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _speed_entries(speed: Any, key: str) -> list[Any]:
    value = (speed or {}).get(key) if isinstance(speed, Mapping) else None
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def speed_problems(speed: Any) -> list[str]:
    """Speed alone must be measured with an interval, and no measurement may say slower."""
    alone = _speed_entries(speed, "alone")
    out = [] if alone else ["speed: no measurement alone"]
    for key in ("alone", "together", "layer"):
        for m in _speed_entries(speed, key):
            if not isinstance(m, Mapping) or not all(_num(m.get(k)) for k in ("estimate", "low", "high")):
                out.append(f"speed {key}: an entry without estimate, low and high")
                continue
            clock = f" ({m['clock']} time)" if m.get("clock") else ""
            where = f"speed {key}{clock} on {m.get('shape') or 'an unnamed shape'}"
            if m["low"] > m["high"]:
                out.append(f"{where}: low {m['low']} is above high {m['high']}")
            if m.get("verdict") == "slower" or m["high"] < 1.0:
                out.append(f"{where}: slower (x{m['estimate']:.3f} [{m['low']:.3f}, {m['high']:.3f}])")
            if not m.get("shape") or not isinstance(m.get("blocks"), int):
                out.append(f"{where}: no shape or no blocks")
    return out


def _claim_problems(loss: Mapping[str, Any], margin: float) -> list[str]:
    """A loss claim: equivalent, within a margin no wider than the stated one, its interval inside it."""
    out = []
    verdict = str(loss.get("verdict") or "")
    if not verdict.startswith("equivalent"):
        out.append(f"loss: {'worse' if 'worse' in verdict else verdict or 'no verdict'}")
    m: Any = loss.get("margin_pct")
    if not _num(m) or m > margin:
        out.append(f"loss: margin {m} % is wider than the stated +-{margin:g} %" if _num(m) else "loss: no margin_pct")
    low: Any = loss.get("low_pct")
    high: Any = loss.get("high_pct")
    if not (_num(low) and _num(high) and _num(loss.get("difference_pct"))):
        out.append("loss: no difference_pct, low_pct and high_pct")
    elif _num(m) and not -m < low <= high < m:
        out.append(f"loss: the interval [{low}, {high}] % is not inside +-{m} %")
    if not isinstance(loss.get("seeds"), int) or loss["seeds"] < 2:
        out.append("loss: fewer than 2 seeds")
    return out


def loss_problems(loss: Any, margin: float, defaults_loss: Any) -> list[str]:
    """The loss part by its kind (``defaults_loss``: the defaults record's, which a numerics record leans on)."""
    if not isinstance(loss, Mapping) or loss.get("kind") not in LOSS_KINDS:
        return [f"loss: no record of a kind in {', '.join(LOSS_KINDS)}"]
    if loss["kind"] == "not measurable here":
        return [] if str(loss.get("reason") or "").strip() else ["loss: not measurable here, without a reason"]
    if loss["kind"] == "paired":
        return _claim_problems(loss, margin)
    numerics = loss.get("numerics")
    out = [] if isinstance(numerics, Mapping) and numerics.get("passed") is True else ["loss: no passed numerics check"]
    if not isinstance(defaults_loss, Mapping) or defaults_loss.get("kind") != "paired" or _claim_problems(
            defaults_loss, margin):
        out.append("loss: numerics+defaults needs the defaults record's own paired test within the margin")
    return out


def record_problems(name: str, record: Any, margin: float, defaults_loss: Any, root: Path | None) -> list[str]:
    """Everything wrong with one toggle's record (empty: admitted)."""
    if not isinstance(record, Mapping):
        return ["no record"]
    out = speed_problems(record.get("speed"))
    out += loss_problems(record.get("loss"), margin, None if name == DEFAULTS else defaults_loss)
    versions = record.get("versions") or {}
    missing = [k for k in VERSION_KEYS if not isinstance(versions, Mapping) or not versions.get(k)]
    if missing:
        out.append(f"versions: no {', '.join(missing)}")
    data = record.get("data")
    if not isinstance(data, list) or not data:
        out.append("data: no files")
    else:
        for path in data:
            if not str(path).startswith(RAW_DIR):
                out.append(f"data: {path} is not under {RAW_DIR}")
            elif root is not None and not (root / str(path)).exists():
                out.append(f"data: {path} does not exist")
    if not str(record.get("covers") or "").strip():
        out.append("covers: not said")
    return out


def check(data: Mapping[str, Any], root: Path | None = None, margin: float = STATED_MARGIN_PCT
          ) -> dict[str, list[str]]:
    """Per required name (and any record of another name): its problems. ``root``: the repository,
    where the data files must exist (None: not looked at)."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        return {"file": [f"format is {got!r}, expected {FORMAT!r}"]}
    records: Mapping[str, Any] = data["records"] if isinstance(data.get("records"), Mapping) else {}
    defaults_loss = (records.get(DEFAULTS) or {}).get("loss") if isinstance(records.get(DEFAULTS), Mapping) else None
    out = {name: record_problems(name, records.get(name), margin, defaults_loss, root) for name in default_on()}
    for name in records:
        if name not in out:
            out[name] = [f"not a default-on toggle of the registry (those: {', '.join(default_on())})"]
    return out


UNRESOLVED_SPAN = 1.10  # an interval whose high is over 1.10 x its low resolves no toggle's few-% effect


def unresolved(alone: Sequence[Mapping[str, Any]], layer: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """The shapes whose speed alone is not resolved: the interval holds 1.0 and spans more than
    UNRESOLVED_SPAN (a record may stand on it, since nothing shows the toggle slower, but the line
    says it is provisional rather than admitted), unless a layer-level entry of that toggle resolves
    it faster where it acts on that shape (measured where the whole run cannot resolve it)."""
    resolved_there = {m.get("shape") for m in layer if m["low"] > 1.0}
    return [str(m.get("shape")) for m in alone if m.get("shape") not in resolved_there
            and m["low"] <= 1.0 <= m["high"] and m["low"] > 0 and m["high"] / m["low"] > UNRESOLVED_SPAN]


def summary_line(name: str, record: Any, problems: Sequence[str]) -> str:
    """One line: admitted (or provisional, where speed alone is not resolved) with its headline
    numbers, or what keeps it out."""
    if problems:
        return f"{name}: NOT ADMITTED: {'; '.join(problems)}"
    alone = _speed_entries(record["speed"], "alone")
    layer = _speed_entries(record["speed"], "layer")
    open_shapes = unresolved(alone, layer)
    if record["loss"]["kind"] == "not measurable here":  # kept on, but nothing here shows it earns its place
        open_shapes = [*open_shapes, "loss: not measurable here"]
    speed = ", ".join(f"x{m['estimate']:.3f} [{m['low']:.3f}, {m['high']:.3f}] on {m['shape']}" for m in alone)
    loss = record["loss"]
    claim = (f"not measurable here ({loss['reason']})" if loss["kind"] == "not measurable here" else
             f"{loss['kind']}" + (f" {loss['difference_pct']:+.2f} % [{loss['low_pct']:+.2f}, {loss['high_pct']:+.2f}], "
                                  f"{loss['verdict']}, {loss['seeds']} seeds" if loss["kind"] == "paired" else ""))
    status = f"PROVISIONAL (not resolved: {'; '.join(open_shapes)})" if open_shapes else "admitted"
    return f"{name}: {status}: speed alone {speed}{_where_it_acts(layer)}; loss {claim}"


def _where_it_acts(layer: Sequence[Mapping[str, Any]]) -> str:
    """The layer-level entries in brief: the first shape's clocks, and how many entries in all."""
    if not layer:
        return ""
    first = [m for m in layer if m["shape"] == layer[0]["shape"]]
    clocks = ", ".join(f"{m.get('clock')} x{m['estimate']:.3f} [{m['low']:.3f}, {m['high']:.3f}]" for m in first)
    more = f" (+{len(layer) - len(first)} more)" if len(layer) > len(first) else ""
    return f"; where it acts ({layer[0].get('unit')}): {clocks} on {layer[0]['shape']}{more}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m megatron_perf_toggles.tools.admission [PATH] (default: docs/benchmarks/admission.json)",
              file=sys.stderr)
        return 2
    path = Path(args[0]) if args else DEFAULT_PATH
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"[perf-toggles] {path}: not a readable admission file ({error})", file=sys.stderr)
        return 2
    root = path.resolve().parents[2] if path.resolve().parent.name == "benchmarks" else None
    found = check(data, root)
    records: Mapping[str, Any] = (data["records"] if isinstance(data, Mapping) and isinstance(data.get("records"), Mapping)
                                  else {})
    for name, problems in found.items():
        print(summary_line(name, records.get(name), problems))
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
