"""Gradient-reduction evidence from logs: NCCL's collective log (``NCCL_DEBUG=INFO
NCCL_DEBUG_SUBSYS=COLL``) and the parameter count Megatron prints.

With the distributed optimizer, each step reduce-scatters the DDP gradient buffer, whose element
size is what ``grad_reduce_in_bf16`` changes (4 bytes fp32, 2 bytes bf16): the bytes NCCL logs per
step, against the bytes computed from the parameter count, show the toggle at work.
"""

from __future__ import annotations

import re

# NCCL's ncclDataType_t values and their sizes in bytes.
NCCL_DTYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
               5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2),
               10: ("float8e4m3", 1), 11: ("float8e5m2", 1)}
NCCL_REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
NCCL_COLL = re.compile(r"\[(?P<dev>\d+)\] NCCL INFO (?P<op>[A-Za-z]+): opCount \w+ .*?\bcount (?P<count>\d+) "
                       r"datatype (?P<dtype>\d+) op (?P<redop>\d+)(?:.*?\[nranks=(?P<nranks>\d+)\])?")


def nccl_traffic(text: str, iters: int, min_elements: int = 1 << 20) -> dict:
    """Collectives of one rank (CUDA device 0) from NCCL's COLL log, large ones summed per step.

    NCCL logs ReduceScatter with the per-rank receive count and AllGather with the per-rank send
    count, so the whole buffer a collective covers is count x nranks; AllReduce logs the buffer.
    """
    totals: dict[str, dict] = {}
    lines = 0
    for m in NCCL_COLL.finditer(text):
        lines += 1
        if m["dev"] != "0":
            continue
        count, nranks = int(m["count"]), int(m["nranks"] or 1)
        name, size = NCCL_DTYPES.get(int(m["dtype"]), (f"dtype{m['dtype']}", 0))
        span = count * (nranks if m["op"] in ("ReduceScatter", "AllGather") else 1)
        key = f"{m['op']}/{name}" + ("" if span >= min_elements else "/small")
        t = totals.setdefault(key, {"calls": 0, "elements": 0, "bytes": 0, "reduce_ops": []})
        t["calls"] += 1
        t["elements"] += span
        t["bytes"] += span * size
        if m["op"] in ("ReduceScatter", "AllReduce", "Reduce"):
            redop = NCCL_REDOPS.get(int(m["redop"]), f"op{m['redop']}")
            if redop not in t["reduce_ops"]:
                t["reduce_ops"].append(redop)
    per_step = {k: {"calls": v["calls"] / iters, "buffer_bytes": v["bytes"] / iters, "reduce_ops": v["reduce_ops"]}
                for k, v in totals.items() if not k.endswith("/small")}
    return {"totals": totals, "large_per_step": per_step, "iterations": iters, "coll_lines": lines}


def param_count(text: str) -> int | None:
    """The model's parameter count from Megatron's startup line."""
    # "(tensor, pipeline) ... (0, 0)" up to 0.19, "(tensor, gtp_remat, pipeline) ... (0, 0, 0)" on main.
    m = re.search(r"number of parameters on \([^)]*\) model parallel rank \([\d, ]+\)\s*:\s*(\d+)",
                  text)
    return int(m.group(1)) if m else None


def grad_buffer_bytes(parameters: int, comm_toggles_on: bool) -> int:
    """The DDP gradient buffer: 2 bytes per parameter with GRAD_REDUCE_IN_BF16, else 4."""
    return parameters * (2 if comm_toggles_on else 4)
