"""Startup cost the plugin adds to a Megatron launch: import, provider, post-parse step.

Megatron's own parser construction and parsing are excluded: each sample parses the same
recorded Megatron surface with and without the plugin and reports the difference. Prints the
numbers; ``--out FILE`` also writes them as JSON (the committed bench/results/startup.json is
rewritten only when named). Target: under 20 ms in total.

    python bench/startup.py [--repeats 30] [--surface main] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_MS = 20.0

# Megatron's megatron/training/arguments.py imports these itself (and torch pulls in far more)
# before any extra_args_provider runs, so their cost is Megatron's, not the plugin's.
MEGATRON_STDLIB = "argparse, dataclasses, json, os, re, types, pathlib, typing, inspect"
IMPORT_PROBE = (
    f"import {MEGATRON_STDLIB}; import time; t=time.perf_counter(); import megatron_perf_toggles; "
    "print((time.perf_counter()-t)*1e3)"
)


def import_ms(repeats: int) -> list[float]:
    """Fresh interpreter each time: the import cost a real launch pays once. Bytecode caching is
    on, as for an installed package: with PYTHONDONTWRITEBYTECODE set, every edited module would be
    compiled again on each import (about twice the time)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, "-c", "import megatron_perf_toggles.runtime.provider"], env=env, check=True)  # warm caches
    out = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, env=env, check=True)
        out.append(float(proc.stdout.strip()))
    return out


def provider_and_parse_ms(repeats: int, surface_name: str) -> tuple[list[float], list[float]]:
    sys.path.insert(0, str(REPO))
    from megatron_perf_toggles.runtime import provider
    from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_BF16
    from megatron_perf_toggles.tools.surfaces import replay

    surface = replay.load_surface(surface_name)
    environ = {"RANK": "1"}  # a non-zero rank: no printing, no file, as on most ranks of a job
    install_ms, post_ms = [], []
    for _ in range(repeats):
        plain = replay.parser_from_surface(surface)
        t0 = time.perf_counter()
        plain.parse_args(LLAMA3_8B_BF16)
        base = time.perf_counter() - t0

        parser = replay.parser_from_surface(surface)
        t0 = time.perf_counter()
        provider.attach(parser, environ=environ)
        t1 = time.perf_counter()
        parser.parse_args(LLAMA3_8B_BF16)
        t2 = time.perf_counter()
        install_ms.append((t1 - t0) * 1e3)
        post_ms.append(max((t2 - t1) - base, 0.0) * 1e3)
    return install_ms, post_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--surface", default="main", help="recorded Megatron surface to parse with")
    ap.add_argument("--out", help="also write the results as JSON here (default: print only)")
    ns = ap.parse_args(argv)
    imp = import_ms(ns.repeats)
    install, post = provider_and_parse_ms(ns.repeats, ns.surface)
    med = {k: statistics.median(v) for k, v in {"import": imp, "provider": install, "post_parse": post}.items()}
    total = sum(med.values())
    result = {
        "median_ms": med,
        "total_median_ms": total,
        "target_ms": TARGET_MS,
        "meets_target": total < TARGET_MS,
        "repeats": ns.repeats,
        "surface": ns.surface,
        "preimported_as_megatron_does": MEGATRON_STDLIB,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    for name, value in med.items():
        print(f"{name:<11} {value:7.2f} ms (median of {ns.repeats})")
    print(f"{'total':<11} {total:7.2f} ms  target < {TARGET_MS:.0f} ms: {'met' if total < TARGET_MS else 'MISSED'}")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
