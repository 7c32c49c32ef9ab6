"""``megatron-perf-toggles layers``: which toggles help on my shape, measured where each acts.

It plans the user's Megatron command line as the launcher's dry run does (the checkout's own parse
and validate), lists each default-on toggle's units (or why one is not measured), and on a GPU builds
and times each unit stock and with the toggle, a toggle's step share summed over its units.
``--check`` (and any machine without a GPU) stops after the list: the commands and the plan,
checked, as ``ablate --dry-run`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import PREFIX, PerfTogglesError
from ...runtime.machine import target as planned
from .design import Row, bf16_main_grads, microbatches_per_step, rows
from .shard import shard_of

DESCRIPTION = (
    "Time each default-on toggle where it acts, on one GPU: each module it changes (the router, the "
    "dispatcher, the MoE layer, attention, the output layer and loss, a transformer layer's and the output "
    "layer's weight gradients) is built from your Megatron arguments, as one rank of your layout holds it, "
    "once stock and once with the toggle, and both are timed forward and backward in one process, "
    "interleaved in a seeded order, with a 95 %% interval per module and the share of a training step the "
    "toggle saves (summed over its modules where it acts in several: gradient accumulation fusion in every "
    "layer and in the output layer). --check (or a machine without a GPU) checks the command line and "
    "prints what would be built.")
EPILOG = ("example: megatron-perf-toggles layers --megatron /path/to/Megatron-LM --step-ms 850 -- "
          "--num-layers 16 --hidden-size 2048 --num-experts 64 --moe-router-topk 6 ... (your pretrain_gpt.py "
          "arguments)")
LAYOUT = (("--tensor-model-parallel-size", "tp"), ("--pipeline-model-parallel-size", "pp"),
          ("--context-parallel-size", "cp"), ("--expert-model-parallel-size", "ep"),
          ("--expert-tensor-parallel-size", "etp"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron", metavar="PATH", help="the Megatron-LM checkout to plan and build with (its "
                   "pretrain_gpt.py parse and validate; required on a GPU; without it --check plans on the "
                   "recorded surface)")
    planned.add_options(p.add_argument_group("the layout to plan for (default: the smallest world the "
                                             "layout's parallel sizes need)"))
    p.add_argument("--toggles", action="append", metavar="A,B", help="registry names to measure (default: every "
                   "default-on toggle)")
    p.add_argument("--blocks", type=int, default=60, help="timed blocks, each arm once per block (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs of each arm first (default 5)")
    p.add_argument("--seed", type=int, default=1234, help="the weights', inputs' and arm order's seed")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--step-ms", type=float, metavar="MS", help="your step time, for the step share")
    step.add_argument("--ablate-results", metavar="FILE", help="an ablate results.json: its baseline's median "
                      "ms/iter is the step time (and, with no arguments after --, its command line the one measured)")
    p.add_argument("--check", action="store_true", help="plan and list only (no GPU needed)")
    p.add_argument("--out", metavar="DIR", default="perf-toggles-layers", help="where layers.json goes")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER, help="your Megatron arguments, after --")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise PerfTogglesError(f"{name} must be 1 or more (got {value})")


def layout_world(megatron_args: list[str]) -> int:
    """The smallest world the command line's parallel sizes need: TP x PP x CP, and a multiple of
    EP x ETP x PP (read through argparse, as Megatron spells the flags)."""
    import math

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, dest in LAYOUT:
        p.add_argument(flag, dest=dest, type=int, default=None)
    ns, _ = p.parse_known_args(megatron_args)
    tp, pp, cp, ep = (getattr(ns, d) or 1 for d in ("tp", "pp", "cp", "ep"))
    etp = ns.etp or tp
    return math.lcm(tp * pp * cp, ep * etp * pp)


Ablated = tuple[dict[str, Any], dict[str, Any], int | None]


def _ablate_results(path: str) -> Ablated:
    """An ablate results.json's baseline row, one of its runs (the command the arms shared) and the
    world its runs had (None: not recorded)."""
    try:
        data = json.loads(Path(path).read_text())
        base = next(r for r in data["rows"] if r.get("baseline"))
        run = next(r for r in data["runs"] if r.get("arm") == base["arm"] and r.get("command"))
        float(base["ms_per_iter"]["median"])
    except (OSError, ValueError, KeyError, StopIteration, TypeError) as error:
        raise PerfTogglesError(f"--ablate-results {path}: no baseline ms/iter and command there ({error})",
                               "pass the results.json an ablate run wrote") from None
    world = data.get("world_size") or data.get("planned_world_size")
    return base, run, int(world) if isinstance(world, int) and world > 0 else None


def args_from_ablate(path: str, ablated: Ablated | None = None) -> list[str]:
    """The Megatron arguments of an ablate result's baseline run (the words after its pretrain_gpt.py)."""
    _base, run, _world = ablated or _ablate_results(path)
    words = [str(w) for w in run["command"]]
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if script is None:
        raise PerfTogglesError(f"--ablate-results {path}: its baseline command names no script")
    return words[script + 1:]


def step_time(ns: argparse.Namespace, ablated: Ablated | None = None) -> dict[str, Any]:
    """The step time the share is taken of, and where it came from (``ablated``: the ablate result read)."""
    if ns.step_ms is not None:
        if ns.step_ms <= 0:
            raise PerfTogglesError(f"--step-ms must be above 0 (got {ns.step_ms:g})")
        return {"ms": ns.step_ms, "source": "--step-ms", "text": f"{ns.step_ms:g} ms (--step-ms)"}
    if ablated is not None:
        base = ablated[0]
        ms = float(base["ms_per_iter"]["median"])
        return {"ms": ms, "source": f"ablate {ns.ablate_results}",
                "text": f"{ms:g} ms (the baseline arm {base['arm']!r} of {ns.ablate_results})"}
    return {"ms": None, "source": None, "text": "none given (--step-ms or --ablate-results): no step share"}


def _plan(ns: argparse.Namespace, ablated_world: int | None) -> tuple[Any, Any, str, dict[str, Any]]:
    """The plan, the capabilities it rests on and the validated arguments: a checkout's own (Megatron's
    types, which the modules are built from), else the recorded surface's parse (enough to list what
    would be built)."""
    from ..planning import checkout_script, plan_command_line, validated_run

    if ns.megatron:
        checkout_script(ns.megatron)
    target = planned.from_options(ns)
    if target.world_size is None and ablated_world:  # the step share counts that world's micro-batches per step
        target = replace(target, world_size=ablated_world, world_source=f"the world of {ns.ablate_results}")
    elif target.world_size is None:
        world = layout_world(ns.megatron_args)
        target = replace(target, world_size=world, world_source="the smallest world of the layout")
    if ns.megatron:
        plan, caps, label, validated = validated_run(ns.megatron, ns.megatron_args, target)
        return plan, caps, label, vars(validated)
    plan, caps, label, args, _launch = plan_command_line(ns.megatron_args, target=target)
    return plan, caps, label, args


def run_layers(ns: argparse.Namespace) -> int:
    for name in ("blocks", "warmup"):
        _positive(f"--{name}", getattr(ns, name))
    if ns.megatron_args[:1] == ["--"]:
        ns.megatron_args = ns.megatron_args[1:]
    ablated = _ablate_results(ns.ablate_results) if ns.ablate_results else None
    if not ns.megatron_args and ablated is not None:
        ns.megatron_args = args_from_ablate(ns.ablate_results, ablated)
    if not ns.megatron_args:
        raise PerfTogglesError("no Megatron arguments", "give your pretrain_gpt.py arguments after -- (or "
                               "--ablate-results FILE: its baseline's)")
    step = step_time(ns, ablated)
    gpu_reason = _why_no_gpu(ns)  # a mistake is one line before the seconds of planning
    plan, caps, label, args = _plan(ns, ablated[2] if ablated else None)
    shard = shard_of(args)
    todo = rows(plan, args, shard, ns.toggles)
    from ...launcher.screen import fit, width
    from .report import plan_lines, result_lines, rows_record, unit_results, write

    size = width(sys.stdout)
    print("\n".join(fit(plan_lines(todo, shard.describe(), label, step, size), size)))
    record: dict[str, Any] = {"command": [str(w) for w in ns.megatron_args], "planned_with": label,
                              "layout": shard.describe(), "step": step, "rows": rows_record(todo)}
    if gpu_reason:
        print(f"\nnot timed: {gpu_reason}")
        return 0
    results = measure(ns, todo, args, shard, step, (plan, caps))
    print("\n".join(fit(result_lines(results, size), size)))
    record.update(results=results, versions=_versions(), blocks=ns.blocks, warmup=ns.warmup, seed=ns.seed)
    print(f"\nrecord: {write(Path(ns.out), record)}")
    if results and all("error" in r for _dest, _unit, r in unit_results({"results": results})):
        print(f"{PREFIX} error: no unit could be built and timed (each row says why)", file=sys.stderr)
        return 1
    return 0


def _why_no_gpu(ns: argparse.Namespace) -> str:
    """Why nothing is timed ("": it is). On a GPU, timing without a checkout is a mistake, said first."""
    from ...runtime.machine.probe import no_gpu_here

    if ns.check:
        return "--check"
    if no_gpu_here():
        return "no GPU visible here (the list above is what a GPU run builds and times)"
    if not ns.megatron:
        raise PerfTogglesError("timing builds Megatron's own modules: pass --megatron PATH",
                               "or --check to plan and list only")
    return ""


def measure(ns: argparse.Namespace, todo: list[Row], args: dict[str, Any], shard: Any, step: dict[str, Any],
            planned: tuple[Any, Any]) -> dict[str, Any]:
    """Build and time each measured unit on this GPU (one that fails says why in one line), grouped by
    toggle with each toggle's summed step share (``report.grouped``). The process is set up first as
    a run of the plan (``planned``: the plan and its capabilities) sets up its own: one rank, and the
    plugin's wgrad fallback where the plan has it (the output layer's fused weight gradient runs on it)."""
    from ...runtime import wgrad_fallback
    from . import gpu_build, gpu_units
    from .analysis import resolved_within, step_share
    from .report import grouped
    from .shard import one_gpu_args

    plan, caps = planned
    sys.path.insert(0, str(Path(ns.megatron).resolve()))
    gpu_build.init_one_rank(ns.seed)
    wgrad_fallback.install_for(plan.wgrad_path, caps.is_assumed("wgrad_fallback"))
    one = one_gpu_args(args, shard)
    per_step = microbatches_per_step(args)
    done: dict[tuple[str, str], dict[str, Any]] = {}
    measured = [r for r in todo if r.measured]
    for i, row in enumerate(measured, 1):
        started = time.monotonic()
        job = gpu_units.Job(one, shard, row.toggle, ns.seed, bf16_main_grads(plan))
        result = gpu_units.measured(job, row.unit.name, ns.blocks, ns.warmup, ns.seed + i)
        if "error" not in result:
            result.update(unit=row.unit.name, resolved_within_1pct=resolved_within(result),
                          step_share=step_share(result["gpu"]["saved_ms"], row.per_microbatch * per_step, step["ms"]))
        done[row.toggle.dest, row.unit.name] = result
        print(f"[{i}/{len(measured)}] {row.toggle.dest}: {row.unit.name}, {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
    return grouped(todo, done)


def _versions() -> dict[str, Any]:
    import torch

    from ...runtime.machine.probe import dist_version

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "transformer_engine": dist_version("transformer-engine", "transformer_engine")}


def main(argv: list[str] | None = None) -> int:
    from ...errors import OneLineArgumentParser, fail

    p = OneLineArgumentParser(prog="megatron-perf-toggles layers", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    try:
        return run_layers(p.parse_args(argv))
    except PerfTogglesError as error:
        fail(error)
