"""Startup cost the plugin adds to a Megatron launch, as users feel it: its share of Megatron's
own parse-and-validate time.

Two measurements:

- the plugin alone (always): its import in a fresh interpreter, installing the provider, and the
  post-parse step, each sample parsing the same recorded Megatron surface with and without the
  plugin and keeping the difference;
- against a real Megatron-LM checkout (``--megatron TREE``): what a launch waits for before its
  arguments are ready, importing ``megatron.training.arguments`` and then ``parse_args`` +
  ``validate_args`` of the tree itself; the parse and validate stock and with the plugin's
  provider (and its safety net) in the chain, alternated in one process. The plugin's share is
  its import plus what it adds to parse and validate, over the stock import, parse and validate.
  The parse and validate alone are reported too: a few milliseconds, against which the plugin's
  per-launch work is measured in absolute terms.

Targets: the plugin adds under 2 % to Megatron's parse and validate, and under 50 ms absolute.
Prints the numbers; ``--out FILE`` also writes them as JSON (the committed
bench/results/startup.json is rewritten only when named).

    python bench/startup.py [--repeats 30] [--surface main] [--megatron TREE] [--out FILE]
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET_MS = 50.0  # absolute: what the plugin may add to a launch
TARGET_SHARE = 0.02  # of Megatron's own parse and validate
# Enough for parse_args + validate_args of pretrain_gpt.py on a CPU box, every supported version.
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--lr", "1e-4", "--train-iters", "1", "--bf16", "--vocab-size", "1000", "--mock-data",
    "--position-embedding-type", "rope", "--no-rope-fusion", "--tokenizer-type", "NullTokenizer",
]
# Runs in a subprocess with the tree first on sys.path: one JSON line of per-sample times (ms).
PARSE_VALIDATE_PROBE = """
import contextlib, io, json, sys, time
from megatron_perf_toggles.launcher.import_shims import megatron_importable
from megatron_perf_toggles.runtime import provider
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES
tree, repeats, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with megatron_importable(tree):
    t = time.perf_counter()
    from megatron.training import arguments
    imported = (time.perf_counter() - t) * 1e3
    def plugin(parser):  # a non-zero rank: no table, no file, as on most ranks of a job
        return provider.attach(parser, environ={"RANK": "1"})
    def once(extra):
        sys.argv = ["pretrain_gpt.py", *argv]
        with PROCESS_CHANGES.scope(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            t = time.perf_counter()
            args = arguments.parse_args(extra_args_provider=extra)
            arguments.validate_args(args, {})
            return (time.perf_counter() - t) * 1e3
    once(None); once(plugin)  # warm: first-call caches are Megatron's, not the plugin's
    stock, with_plugin = [], []
    for _ in range(repeats):
        stock.append(once(None))
        with_plugin.append(once(plugin))
print(json.dumps({"import": imported, "stock": stock, "with_plugin": with_plugin}))
"""

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


def parse_validate_ms(tree: str, repeats: int) -> dict[str, Any]:
    """Megatron's parse_args + validate_args on ``tree``, stock and with the plugin (see the module
    docstring), in one subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    env["PYTHONPATH"] = os.pathsep.join([tree, str(REPO)])
    env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "-c", PARSE_VALIDATE_PROBE, tree, str(repeats), *MEGATRON_ARGS],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise SystemExit(f"startup.py: parse and validate on {tree} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def megatron_share(tree: str, repeats: int, import_median_ms: float) -> dict[str, Any]:
    """The plugin's cost (its import, plus what it adds to parse and validate) over Megatron's own
    import, parse and validate of ``tree``."""
    times = parse_validate_ms(tree, repeats)
    stock = statistics.median(times["stock"])
    with_plugin = statistics.median(times["with_plugin"])
    added = max(with_plugin - stock, 0.0)
    plugin_ms = import_median_ms + added
    share = plugin_ms / (times["import"] + stock)
    return {"tree": os.path.basename(os.path.normpath(tree)),  # its name: no machine path in results
            "stock_ms": stock, "with_plugin_ms": with_plugin, "added_ms": added,
            "plugin_ms": plugin_ms, "share": share, "megatron_import_ms": times["import"],
            "target_share": TARGET_SHARE, "meets_target": share < TARGET_SHARE and plugin_ms < TARGET_MS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--surface", default="main", help="recorded Megatron surface to parse with")
    ap.add_argument("--megatron", metavar="TREE", help="a Megatron-LM checkout: also measure the plugin's share "
                    "of its parse_args + validate_args")
    ap.add_argument("--out", help="also write the results as JSON here (default: print only)")
    ns = ap.parse_args(argv)
    if ns.megatron and not (Path(ns.megatron) / "megatron" / "training" / "arguments.py").is_file():
        ap.exit(2, f"startup.py: --megatron {ns.megatron}: not a Megatron-LM checkout (no megatron/training/arguments.py)\n")
    imp = import_ms(ns.repeats)
    install, post = provider_and_parse_ms(ns.repeats, ns.surface)
    med = {k: statistics.median(v) for k, v in {"import": imp, "provider": install, "post_parse": post}.items()}
    total = sum(med.values())
    result: dict[str, Any] = {
        "median_ms": med,
        "total_median_ms": total,
        "target_ms": TARGET_MS,
        "meets_target": total < TARGET_MS,
        "repeats": ns.repeats,
        "surface": ns.surface,
        "preimported_as_megatron_does": MEGATRON_STDLIB,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_average_1min": round(os.getloadavg()[0], 2),  # other work on the machine inflates every time
    }
    for name, value in med.items():
        print(f"{name:<11} {value:7.2f} ms (median of {ns.repeats})")
    print(f"{'total':<11} {total:7.2f} ms  target < {TARGET_MS:.0f} ms: {'met' if total < TARGET_MS else 'MISSED'}")
    if ns.megatron:
        result["megatron"] = share = megatron_share(ns.megatron, ns.repeats, med["import"])
        print(f"Megatron at {ns.megatron}: import {share['megatron_import_ms'] / 1e3:.2f} s, then parse+validate "
              f"{share['stock_ms']:.1f} ms stock, {share['with_plugin_ms']:.1f} ms with the plugin")
        print(f"plugin share {100 * share['share']:.2f} % ({share['plugin_ms']:.1f} ms: its import + "
              f"{share['added_ms']:.1f} ms added to parse+validate)  target < {100 * TARGET_SHARE:.0f} % and "
              f"< {TARGET_MS:.0f} ms: {'met' if share['meets_target'] else 'MISSED'}")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
