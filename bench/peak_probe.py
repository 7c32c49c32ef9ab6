"""Run a script (or ``-m module``) and write its CUDA memory peaks as JSON when it ends, however it ends.

    python bench/peak_probe.py OUT.json SCRIPT [ARGS...]
    python bench/peak_probe.py OUT.json -m MODULE [ARGS...]

The record: status (ran | oom | error), the error's first lines, torch's peak allocated and peak
reserved memory (MB of 2**20 bytes) over the whole process, the card's total memory as torch reports
it, and the largest request the allocator refused where it ran out of memory.
"""

from __future__ import annotations

import atexit
import json
import re
import runpy
import sys

OUT = sys.argv[1]
STATE: dict[str, object] = {"status": "ran", "error": None}


def _dump() -> None:
    record = dict(STATE)
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            record["max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            record["max_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
            record["total_mb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**20, 1)
    except Exception as error:  # noqa: BLE001 - the record is still written
        record["probe_error"] = repr(error)
    with open(OUT, "w") as fh:
        json.dump(record, fh, indent=1)


atexit.register(_dump)


def main() -> None:
    if sys.argv[2] == "-m":
        sys.argv = sys.argv[3:]
        target, runner = sys.argv[0], runpy.run_module
    else:
        sys.argv = sys.argv[2:]
        target, runner = sys.argv[0], runpy.run_path
    try:
        runner(target, run_name="__main__", alter_sys=True) if runner is runpy.run_module \
            else runner(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:
        text = str(error)
        # Only torch's OutOfMemoryError is the caching allocator giving up on GPU memory; a CUDA error
        # that says "out of memory" can come from elsewhere (a pinned host allocation, a kernel launch).
        oom = type(error).__name__ == "OutOfMemoryError"
        STATE.update(status="oom" if oom else "error", error=f"{type(error).__name__}: {text[:800]}")
        asked = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB)", text)
        if asked:
            STATE["refused_request_mb"] = float(asked.group(1)) * (1024 if asked.group(2) == "GiB" else 1)
        raise


if __name__ == "__main__":
    main()
