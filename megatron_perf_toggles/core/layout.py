"""Whether a planned world can hold the job's parallel layout, checked the same way on every path.

Megatron refuses a world its model-parallel sizes do not divide (``validate_args`` and
``parallel_state``), and its ``TransformerConfig`` refuses attention heads that tensor parallelism
does not divide. A plan on a recorded surface, a Bridge recipe or a Primus file runs neither, so
without this check a layout that cannot start would be planned (exit 0). One function, fed
Megatron's argument names, says it in one line for every front end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PerfTogglesError


class LayoutError(PerfTogglesError):
    """A world size, or a model shape, that the parallel layout does not divide. ``names``: the words
    Megatron's own refusal of the same mistake holds (``about``)."""

    def __init__(self, message: str, hint: str, names: tuple[str, ...] = ("world size",)) -> None:
        super().__init__(message, hint)
        self.names = names

    def about(self, text: str) -> bool:
        """Whether Megatron's refusal ``text`` is about this mistake (so this fix is the fix for it)."""
        words = text.lower().replace("_", " ")
        return all(name in words for name in self.names)


def _size(args: Mapping[str, Any], dest: str, default: int = 1) -> int:
    value = args.get(dest)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _world_words(world: int, source: str) -> str:
    return source or f"no --world-size given, so a world of {world} was planned"


def check(world: int, args: Mapping[str, Any], source: str = "", *, groups_may_divide_tp: bool,
          resize: str = "--world-size N") -> None:
    """Refuse, in one line, a ``world`` that TP x PP x CP (or, for experts, EP x ETP x PP) does not
    divide, or attention heads / query groups that TP does not divide. ``source`` says where the
    world came from (``--world-size 8``); empty means nothing named it. ``groups_may_divide_tp``:
    the Megatron planned for also takes query groups that divide TP (rule ``gqa_groups_divide_tp``,
    core 0.16 on: each rank then holds one group). ``resize``: how the command that asked names
    another world, for the fix."""
    tp, pp, cp = (_size(args, d) for d in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                            "context_parallel_size"))
    model = tp * pp * cp
    hint = f"{_world_words(world, source)}; plan a world that is a multiple of {{n}} ({resize})"
    if world % model:
        raise LayoutError(f"world size {world} is not divisible by TP x PP x CP = {model} ({tp} x {pp} x {cp})",
                          hint.format(n=model))
    ep = _size(args, "expert_model_parallel_size")
    etp = _size(args, "expert_tensor_parallel_size", tp)
    if ep * etp > 1 and world % (ep * etp * pp):
        experts = ep * etp * pp
        raise LayoutError(f"world size {world} is not divisible by EP x ETP x PP = {experts} ({ep} x {etp} x {pp})",
                          hint.format(n=experts))
    _check_shape(args, tp, ep, groups_may_divide_tp)


def _check_shape(args: Mapping[str, Any], tp: int, ep: int, groups_may_divide_tp: bool) -> None:
    """The shape checks Megatron makes before any GPU work: heads and query groups over TP, experts over EP."""
    for dest, words in (("num_attention_heads", "attention heads"), ("num_query_groups", "query groups")):
        count = args.get(dest)
        if dest == "num_query_groups" and not args.get("group_query_attention"):
            continue
        if not isinstance(count, int) or count <= 0 or not count % tp:
            continue
        # The legacy model (--use-legacy-models, up to core 0.17) still wants a multiple of TP.
        if dest == "num_query_groups" and groups_may_divide_tp and not args.get("use_legacy_models"):
            if tp % count:
                raise LayoutError(f"{count} {words} ({dest}) neither divide nor are divisible by tensor "
                                  f"parallelism {tp}", "choose a TP that divides them or that they divide",
                                  (words, "tensor"))
            continue
        raise LayoutError(f"{count} {words} ({dest}) are not divisible by tensor parallelism {tp}",
                          "choose a TP that divides them", (words, "tensor"))
    experts = args.get("num_experts")
    if isinstance(experts, int) and experts > 0 and experts % ep:
        raise LayoutError(f"{experts} experts (num_experts) are not divisible by expert parallelism {ep}",
                          "choose an EP that divides them", ("experts", "expert model parallel"))


def parallel(world: int, args: Mapping[str, Any]) -> dict[str, Any]:
    """The job's parallel layout as a plan shows it (``explain``'s text and JSON, the dry run's
    summary and record): TP, PP, CP, EP (with ETP where it differs from TP), the data-parallel size
    the world leaves (None where the world does not divide), virtual pipeline stages and sequence
    parallelism where set. A configuration front end's recipe says its layout only here."""
    tp, pp, cp = (_size(args, d) for d in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                            "context_parallel_size"))
    ep = _size(args, "expert_model_parallel_size")
    vpp = args.get("virtual_pipeline_model_parallel_size")
    return {"world": world, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
            "etp": _size(args, "expert_tensor_parallel_size", tp),
            "dp": world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None,
            "vpp": vpp if isinstance(vpp, int) and not isinstance(vpp, bool) and vpp > 1 else None,
            "sequence_parallel": bool(args.get("sequence_parallel")) and tp > 1}


def words(layout: Mapping[str, Any]) -> str:
    """``TP 2, PP 4, CP 1, EP 1, DP 8 (world 64), sequence parallel``: :func:`parallel` in one line."""
    parts = [f"TP {layout['tp']}", f"PP {layout['pp']}"]
    parts += [f"VPP {layout['vpp']}"] if layout.get("vpp") else []
    parts += [f"CP {layout['cp']}", f"EP {layout['ep']}"]
    parts += [f"ETP {layout['etp']}"] if layout["ep"] > 1 and layout["etp"] != layout["tp"] else []
    dp = layout["dp"] if layout["dp"] is not None else "-"
    out = f"{', '.join(parts)}, DP {dp} (world {layout['world']})"
    return out + (", sequence parallel" if layout.get("sequence_parallel") else "")
