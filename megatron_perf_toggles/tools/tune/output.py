"""tune's output: OUT/profile.json (``core.profile.render_profile``) and OUT/profile.md, the review."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...core.profile import Evidence, Profile, render_profile
from ...core.registry import format_value


def _interval(ev: Evidence) -> str:
    if ev.speedup is None:
        return "-"
    if ev.low is None or ev.high is None:
        return f"{ev.speedup:.3f}"
    return f"{ev.speedup:.3f} [{ev.low:.3f}, {ev.high:.3f}]"


def summary(profile: Profile, path: Path, excluded: Mapping[str, str], results: Mapping[str, Mapping[str, Any]]
            ) -> str:
    """OUT/profile.md: what was chosen and why, for the review the profile is meant to get."""
    env = profile.environment
    lines = [f"# Profile `{path.name}`", "",
             f"Measured {profile.created} with {profile.made_by}: Megatron {env.megatron or '?'}, Transformer Engine "
             f"{env.transformer_engine or 'none'}, torch {env.torch or '?'}, GPU {env.gpu or 'not known'}, world size "
             f"{env.world_size or 'not recorded'}.", "", f"Command: `{profile.command}`", "",
             "| toggle | value | speedup of the value over the other [CI] | verdict | loss ratio (loss test) "
             "| peak memory vs the other (MB) | how |",
             "|---|---|---|---|---|---|---|"]
    for dest, choice in profile.toggles.items():
        ev = choice.evidence
        assert ev is not None  # tune records evidence for every toggle it decides
        loss = "-" if ev.loss_ratio is None else f"{ev.loss_ratio:.4f}"
        loss += f" ({ev.loss_verdict})" if ev.loss_verdict else ""
        memory = "-" if ev.peak_memory_delta_mb is None else f"{ev.peak_memory_delta_mb:+.0f}"
        lines.append(f"| {dest} | {format_value(choice.value)} | {_interval(ev)} | {ev.verdict} | {loss} | {memory} "
                     f"| {ev.rule} |")
    for dest, why in excluded.items():
        lines.append(f"| {dest} | (not in the profile) | - | - | - | - | a guard keeps it off here: {why} |")
    if profile.notes:
        lines += ["", profile.notes + "."]
    lines += ["", "Intervals: paired t over blocks; a value turned off in leave-one-out and the factorial's at the "
              "corrected confidence they were decided with."]
    conf = profile.confirmation
    if conf is not None:
        if conf.verdict:
            interval = "-" if conf.speedup is None else _interval(Evidence(False, conf.speedup, conf.low, conf.high))
            lines += ["", f"Confirmation (defaults over chosen, {conf.blocks or 0} block(s)): {interval}, "
                      f"{conf.verdict}; {conf.outcome}."]
        else:  # not run, or cut short before a comparison: the outcome says which
            lines += ["", f"Confirmation (defaults over chosen): {conf.outcome}."]
    for phase, result in results.items():
        lines.append(f"- {phase}: {result['blocks_run']} block(s), results in `{phase}/results.md`"
                     + (f"; stopped: {result['stop_reason']}" if result.get("stop_reason") else ""))
    lines += ["", f"Use it: `MEGATRON_PERF_TOGGLES_PROFILE={path} <your launch>`; "
              "`megatron-perf-toggles explain` with the same variable shows what it decides."]
    return "\n".join(lines) + "\n"


def write_profile(out: Path, profile: Profile, excluded: Mapping[str, str],
                  results: Mapping[str, Mapping[str, Any]]) -> Path:
    path = out / "profile.json"
    tmp = out / ".profile.json.tmp"
    tmp.write_text(render_profile(profile))
    os.replace(tmp, path)  # a reader (or a launch) never sees half a profile
    (out / "profile.md").write_text(summary(profile, path, excluded, results))
    return path
