"""What each choice of a profile quotes: step time and loss against the arm that differs in that
toggle alone, peak memory, the environment measured, and the memory limit's turn-offs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...core.profile import Choice, Environment, Evidence
from ...core.registry import BY_DEST
from ..ablate import stats
from ..ablate.loss import equivalence
from ..ablate.loss.loss_test import train_window_mean
from .rule import Decided, say, step_ms

LOSS_MARGIN = 1.0  # % of the other value's loss: ablate's default margin
LOSS_ALPHA = 0.05


def _loss(chosen: Sequence[Mapping[str, Any] | None], against: Sequence[Mapping[str, Any] | None]
          ) -> tuple[float | None, str]:
    """The loss with the chosen value over the loss with the other at the last iteration both
    logged (the median of the per-block ratios), and ablate's loss test of the pair, block by block,
    on each run's mean training loss over its last tenth ("" where no block has both). A phase's
    blocks repeat one seed: the verdict says whether the value moves the loss on that seed by more
    than the margin, not a claim across seeds (ablate --block-seeds makes that)."""
    common = stats.loss_iterations(chosen) & stats.loss_iterations(against)
    ratio = None
    if common:
        last = max(common)
        ratio = (stats.loss_comparison(stats.losses_at(against, last), stats.losses_at(chosen, last)) or {}).get(
            "ratio")
    mine = [train_window_mean(r, None) for r in chosen]
    other = [train_window_mean(r, None) for r in against]
    if not any(m is not None and o is not None for m, o in zip(mine, other, strict=True)):
        return ratio, ""
    return ratio, equivalence.paired(mine, other, LOSS_MARGIN, LOSS_ALPHA)["verdict"]


def evidence(decided: Decided, result: Mapping[str, Any]) -> Evidence:
    """Step time with the other value over step time with the chosen one, paired by block; the
    loss as :func:`_loss` compares the same pair."""
    blocks = result["blocks_run"]
    chosen = stats.by_block(result["runs"], decided.chosen, blocks)
    against = stats.by_block(result["runs"], decided.against, blocks)
    sp = stats.paired_speedup([step_ms(r) for r in against], [step_ms(r) for r in chosen],
                              decided.confidence or result["confidence"])
    ratio, loss_verdict = _loss(chosen, against)
    toggle = BY_DEST.get(decided.dest)
    if loss_verdict and toggle is not None and toggle.redraws_init:  # same seed, other initial weights
        loss_verdict = f"not paired: {decided.dest} draws the initial weights another way"
    return Evidence(against=not decided.value, speedup=sp.get("estimate"), low=sp.get("low"), high=sp.get("high"),
                    verdict=sp["verdict"], confidence=sp["confidence"], blocks=sp["blocks"],
                    design=decided.phase, loss_ratio=ratio, loss_verdict=loss_verdict,
                    rule=decided.rule, peak_memory_delta_mb=memory_change(result, decided.chosen, decided.against))


def peak_mb(result: Mapping[str, Any], arm: str) -> float | None:
    """An arm's measured peak allocated MB (the highest over its finished runs), None if not logged."""
    row = next((r for r in result.get("rows", []) if r["arm"] == arm), None)
    return None if row is None else row.get("max_allocated_mb")


def memory_change(result: Mapping[str, Any], chosen: str, against: str) -> float | None:
    """Peak allocated MB with the chosen arm minus with the other one."""
    a, b = peak_mb(result, chosen), peak_mb(result, against)
    return None if a is None or b is None else round(a - b, 1)


def within_memory_limit(choices: Mapping[str, Choice], first: Mapping[str, Any], limit_gb: float | None
                        ) -> tuple[dict[str, Choice], str]:
    """Keep the choices within ``--memory-limit-gb``: the peak of a set of choices is read from
    leave-one-out as all-on's peak plus, for each toggle chosen off, what removing it changed
    (measured; the toggles' memory terms add up, docs/memory.md). While it is above the limit, the
    toggle whose removal lowers the peak most is turned off, with the numbers in its rule. Returns
    the choices and a line for the profile's review ('' where no limit was given)."""
    if limit_gb is None:
        return dict(choices), ""
    limit = limit_gb * 1024
    base = peak_mb(first, "all-on")
    if base is None:
        return dict(choices), f"--memory-limit-gb {limit_gb:g}: not applied, leave-one-out logged no peak memory"
    without = {d: peak_mb(first, f"without:{d}") for d in choices}
    saving: dict[str, float] = {d: base - mb for d, mb in without.items() if mb is not None}

    def peak(cs: Mapping[str, Choice]) -> float:
        return base - sum(saving.get(d, 0.0) for d, c in cs.items() if c.value is False)

    out = dict(choices)
    while peak(out) > limit:
        candidates = [d for d, c in out.items() if c.value is not False and saving.get(d, 0.0) > 0]
        if not candidates:
            return out, (f"--memory-limit-gb {limit_gb:g}: the choices peak at {peak(out) / 1024:.1f} GB per GPU "
                         "(measured), and no toggle left on lowers it: above the limit")
        dest = max(candidates, key=lambda d: saving[d])
        before = peak(out)
        rule = (f"off: --memory-limit-gb {limit_gb:g}; with it on the choices peak at {before / 1024:.1f} GB per GPU "
                f"(measured), removing it saves {saving[dest]:.0f} MB")
        out[dest] = Choice(False, Evidence(against=True, verdict="memory limit", design="leave-one-out", rule=rule,
                                           peak_memory_delta_mb=-round(saving[dest], 1)))
        say(f"{dest} off: {rule}")
    return out, f"--memory-limit-gb {limit_gb:g}: the choices peak at {peak(out) / 1024:.1f} GB per GPU (measured)"


def measured_on(record: Mapping[str, Any], world: int | None) -> Environment:
    """What the runs ran on: the baseline's dry-run record (Megatron, TE, torch, the GPU that
    process saw) and ``world``, the runs' world size (the results' ``world_size``; None: not
    recorded). The dry run's record is not asked for it: the dry run is one process planning for
    a world, not the runs themselves. No torch is imported here."""
    caps = record.get("capabilities") or {}
    te = caps.get("te_version")
    return Environment(megatron=(record.get("megatron") or {}).get("version"),
                       transformer_engine=None if te == "unknown" else te, torch=caps.get("torch_version"),
                       gpu=record.get("gpu_visible"),
                       world_size=world)
