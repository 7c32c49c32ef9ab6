"""One process's GPU memory outside what the memory model prices: the CUDA context, cuBLAS's
workspace, NCCL's buffers, and Transformer Engine's where it is installed.

``ablate --concurrent K`` runs K processes on one GPU; before any starts it checks that K of them
fit: each run's planned peak (the plugin's memory model) plus this overhead, per process. The
overhead is measured here, not guessed: a small MoE run priced at 1.7 GB made 16 at once look like
a fit on an 80 GB card, and all 16 died in NCCL.

Each step's cost is the device memory in use after it less before it, as the driver counts it
(device-wide: run this on an idle GPU). Before any CUDA use the reading comes from NVML (torch's
``device_memory_used`` where this torch has it, else ``nvidia-smi``), since
``torch.cuda.mem_get_info`` would itself create the context it is to measure; from the context on,
from ``torch.cuda.mem_get_info`` (total less free). Tensors a step makes are freed, and torch's
cache emptied, before its reading: what stays is the process's own.

    python bench/process_overhead.py [--device 0] [--no-te] [--out docs/benchmarks/process_overhead.json]

The file written is the one ablate reads (``measured.overhead_mb``; the steps, the GPU and the
versions beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MB = 2**20
WHAT = ("one process's GPU memory outside what the memory model prices (the CUDA context, cuBLAS's workspace, "
        "NCCL's buffers, Transformer Engine's): ablate --concurrent K adds it to each run's planned peak")
HOW = "python bench/process_overhead.py --out docs/benchmarks/process_overhead.json (on an idle GPU)"


def nvml_used_mb(torch: Any, device: int) -> float | None:
    """The device memory in use as NVML counts it, without creating a CUDA context (None: no NVML)."""
    reader = getattr(getattr(torch, "cuda", None), "device_memory_used", None)
    if reader is not None:
        try:
            return float(reader(device)) / MB
        except Exception:  # noqa: BLE001 - no pynvml behind it: ask nvidia-smi
            pass
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible[device].strip() if device < len(visible) else str(device)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return float(out.stdout.strip().splitlines()[0])  # MiB
    except (IndexError, ValueError):
        return None


def cuda_used_mb(torch: Any) -> float:
    free, total = torch.cuda.mem_get_info()
    return float(total - free) / MB


def _settle(torch: Any) -> None:
    """What a step made is freed: only what the process keeps stays in the next reading."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def cublas_matmul(torch: Any) -> None:
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()


def nccl_all_reduce(torch: Any) -> Any:
    """A one-rank NCCL process group and one all_reduce (NCCL makes its communicator at the first
    collective); the group is kept, as a run keeps it."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    x.sum().item()
    return dist


def te_linear(torch: Any) -> None:
    import transformer_engine.pytorch as te

    layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)).sum().item()


def te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def measure(torch: Any, device: int, with_te: bool) -> dict[str, Any]:
    """Each step's MB (after less before) and the whole; the readings beside them."""
    before = nvml_used_mb(torch, device)
    if before is None:
        raise SystemExit("process_overhead: no NVML reading (no pynvml for torch.cuda.device_memory_used, and no "
                         "nvidia-smi): the CUDA context cannot be measured without one")
    torch.cuda.set_device(device)
    cuda_before = cuda_used_mb(torch)  # creates the context: what it costs, NVML says
    context = nvml_used_mb(torch, device)
    steps: list[dict[str, Any]] = [{"step": "CUDA context", "mb": round((context or before) - before, 1),
                                    "reader": "nvml", "cuda_used_after_mb": round(cuda_before, 1)}]
    work: list[tuple[str, Callable[[Any], Any]]] = [("cuBLAS bf16 matmul", cublas_matmul),
                                                    ("NCCL one-rank process group and all_reduce", nccl_all_reduce)]
    if with_te:
        work.append(("Transformer Engine import and te.Linear forward", te_linear))
    kept = []
    last = cuda_before
    for name, step in work:
        kept.append(step(torch))
        _settle(torch)
        now = cuda_used_mb(torch)
        steps.append({"step": name, "mb": round(now - last, 1), "reader": "mem_get_info",
                      "cuda_used_after_mb": round(now, 1)})
        last = now
    after = nvml_used_mb(torch, device)
    return {"steps": steps, "overhead_mb": round(sum(s["mb"] for s in steps), 1),
            "used_before_mb": round(before, 1),
            "nvml_whole_mb": None if after is None else round(after - before, 1),
            "torch_reserved_mb": round(torch.cuda.memory_reserved() / MB, 1)}


def versions(torch: Any, with_te: bool) -> dict[str, Any]:
    nccl = None
    try:
        nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a build without NCCL
        pass
    te = None
    if with_te:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", None)
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "transformer_engine": te}


def table(measured: dict[str, Any]) -> str:
    lines = [f"GPU {measured['gpu']}: torch {measured['torch']}, CUDA {measured['cuda']}, NCCL {measured['nccl']}, "
             f"Transformer Engine {measured['transformer_engine'] or 'not measured'}",
             f"{'step':<52} {'MB':>9}"]
    lines += [f"{s['step']:<52} {s['mb']:>9.1f}" for s in measured["steps"]]
    lines.append(f"{'one process, in all (overhead_mb)':<52} {measured['overhead_mb']:>9.1f}")
    if measured["nvml_whole_mb"] is not None:
        lines.append(f"{'(NVML, start to end)':<52} {measured['nvml_whole_mb']:>9.1f}")
    if measured["used_before_mb"] > 1024:
        lines.append(f"warning: {measured['used_before_mb']:.0f} MB were in use before this process started: "
                     "another process shares the GPU, and the readings are device-wide")
    return "\n".join(lines)


def payload(measured: dict[str, Any] | None) -> dict[str, Any]:
    """The file ablate reads (schedule.process_overhead): what it holds and how to make it, and the
    measurement (None until one is made)."""
    return {"what": WHAT, "how": HOW, "measured": measured}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device", type=int, default=0, help="the GPU to measure (default 0)")
    p.add_argument("--no-te", action="store_true", help="leave Transformer Engine out even where it is installed")
    p.add_argument("--out", type=Path, help="write the measurement here (as docs/benchmarks/process_overhead.json)")
    ns = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("process_overhead: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():  # asks the driver; creates no context
        print("process_overhead: no CUDA GPU visible", file=sys.stderr)
        return 2
    with_te = te_available() and not ns.no_te
    measured = measure(torch, ns.device, with_te)
    measured = {**versions(torch, with_te), **measured}
    print(table(measured))
    if ns.out:
        ns.out.write_text(json.dumps(payload(measured), indent=1) + "\n")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
