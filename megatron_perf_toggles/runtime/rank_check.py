"""Every rank must run the same toggles: compare fingerprints right after process-group start.

Ranks that build different gradient buffers, collectives or kernels hang at the first
collective or silently compute wrong gradients. So, as soon as ``torch.distributed`` is
initialised (before the model is built), every rank contributes a small fingerprint (its toggle
decisions and the capabilities they rest on) to one all-gather, and every rank raises the same
RankMismatchError when they differ.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from typing import Any

from ..core.registry import BY_DEST
from .context import RunContext, current, for_process

CAPABILITY_KEYS = ("te_version", "apex_fused_wgrad", "wgrad_fallback", "aiter_version", "device")


class RankMismatchError(RuntimeError):
    """Ranks decided different toggles; raised on every rank, with the same message."""


def fingerprint(decisions: Mapping[str, Any], capabilities: Mapping[str, Any], wgrad_path: str = "") -> dict[str, Any]:
    values = {dest: (d["value"] if isinstance(d, Mapping) else d) for dest, d in decisions.items()}
    caps = {k: capabilities.get(k) for k in CAPABILITY_KEYS}
    return {"toggles": values, "capabilities": caps, "wgrad_path": wgrad_path}


def _fingerprint_of(context: RunContext | None) -> dict[str, Any] | None:
    return None if context is None else context.rank_fingerprint


def arm(fp: dict[str, Any], enabled: bool = True, context: RunContext | None = None) -> None:
    """Remember this rank's fingerprint on the run context and check it as soon as the process
    group exists. Without a context (a controller used on its own), the installed one holds it,
    or one is installed for the process: ``check_ranks()`` is called bare, after
    ``init_process_group``, and reads it from there."""
    context = context or for_process("rank check")
    context.rank_fingerprint = dict(fp)
    undo = context.undo
    dist = _dist()
    if dist is None:
        return
    hooked = dist.init_process_group
    if not enabled:
        # An earlier parse in this process (or a forked parent) may have armed the check.
        if getattr(hooked, "_perf_toggles_wrapped", False):
            undo.set_attr(dist, "init_process_group", hooked.__wrapped__)
        return
    if dist.is_available() and dist.is_initialized():
        check_ranks()
        return
    if getattr(hooked, "_perf_toggles_wrapped", False):
        return
    original = hooked

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        dist.init_process_group = original  # one check per process
        if _fingerprint_of(context):
            check_ranks()
        return result

    init_process_group._perf_toggles_wrapped = True  # type: ignore[attr-defined]
    undo.set_attr(dist, "init_process_group", init_process_group, "torch.distributed.init_process_group (rank check)")


def _dist() -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, "distributed", None) if torch is not None else None


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def describe_mismatch(entries: list[dict[str, Any]]) -> str | None:
    """``entries``: one ``{"rank", "host", "fp"}`` per rank. None when all fingerprints agree."""
    lines: list[str] = []
    for section in ("toggles", "capabilities", "wgrad_path"):
        keys = sorted({k for e in entries for k in (e["fp"].get(section) or {})}) if section != "wgrad_path" else [""]
        for key in keys:
            groups: dict[str, list[dict[str, Any]]] = {}
            for e in entries:
                value = e["fp"].get(section) if section == "wgrad_path" else (e["fp"].get(section) or {}).get(key)
                groups.setdefault(json.dumps(value), []).append(e)
            if len(groups) < 2:
                continue
            name = key or section
            parts = []
            for value, members in sorted(groups.items(), key=lambda kv: min(m["rank"] for m in kv[1])):
                hosts = ",".join(sorted({m["host"] for m in members}))
                parts.append(f"{value} on ranks {_ranges([m['rank'] for m in members])} ({hosts})")
            fix = ""
            if section == "toggles" and key in BY_DEST:
                fix = f"; set {BY_DEST[key].env} (and the flags) the same on every node"
            elif section == "capabilities":
                fix = "; install the same packages on every node"
            lines.append(f"{name}: " + " vs ".join(parts) + fix)
    if not lines:
        return None
    return "perf-toggles differ across ranks, stopping before the first iteration: " + " | ".join(lines)


def check_ranks(group: Any = None) -> None:
    """All-gather every rank's fingerprint and raise RankMismatchError on every rank if they differ.

    Call after ``init_process_group`` on any backend (NCCL on GPUs, gloo on CPU). Uses this
    process's decisions as recorded by the plugin's post-parse step.
    """
    dist = _dist()
    if dist is None or not dist.is_initialized():
        raise RuntimeError("check_ranks() needs torch.distributed to be initialised first")
    import socket

    import torch

    payload = json.dumps(
        {"rank": dist.get_rank(), "host": socket.gethostname(), "fp": _fingerprint_of(current()) or {}}, sort_keys=True
    ).encode()
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    size = int(max(t.item() for t in lengths))
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    entries = [json.loads(bytes(b[: int(n.item())].cpu().tolist()).decode()) for b, n in zip(bufs, lengths, strict=True)]
    message = describe_mismatch(entries)
    if message:
        raise RankMismatchError(message)
