"""How long a bad input takes to be reported: a bad setting or ``--extra-args-provider`` on the
launcher path, and a bad command line to ``megatron-perf-toggles``.

Each sample starts a fresh process (as a user's launch would) with one bad value and times it to
its one-line error and exit status 2. The checks run before Megatron or torch is imported, so the
time does not depend on the checkout or the GPU. Target: under 1 s.

    python bench/fail_fast.py --megatron /path/to/Megatron-LM [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
BAD = {
    "bad toggle value": {"FUSED_SINGLE_QKV_ROPE": "maybe"},
    "bad profile": {"MEGATRON_PERF_TOGGLES_PROFILE": "/no/such/profile.json"},
    "unknown GPU": {"MEGATRON_PERF_TOGGLES_PLAN": "64:h10"},
    "bad world size": {"MEGATRON_PERF_TOGGLES_PLAN": "0:h100"},
}
# Bad --extra-args-provider specs on the launcher path (a misspelt module, a malformed spec).
BAD_PROVIDERS = {
    "provider: no module": "no_such_provider_module:add",
    "provider: malformed": "not a spec",
}
# Bad command lines to the command-line tool (argv after ``python -m megatron_perf_toggles``).
BAD_COMMANDS = {
    "explain: no checkout": ["explain", "--megatron", "/no/such/Megatron-LM"],
    "doctor: no checkout": ["doctor", "--megatron", "/no/such/Megatron-LM"],
    "explain: contradiction": ["explain", "--", "--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16"],
    "explain: bad world": ["explain", "--world-size", "0"],
}


def sample(tree: str, env: dict[str, str], command: list[str] | None = None, extra: tuple[str, ...] = ()
           ) -> tuple[float, int, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    full.update(env, PYTHONPATH=os.pathsep.join([str(REPO), tree]))
    argv = ["-m", "megatron_perf_toggles", *command] if command else [
        "-m", "megatron_perf_toggles.run", "--dry-run", *extra, f"{tree}/pretrain_gpt.py", "--num-layers", "2"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=full, capture_output=True, text=True, check=False)
    return time.perf_counter() - start, done.returncode, done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron", required=True, metavar="PATH", help="a Megatron-LM checkout")
    ap.add_argument("--repeats", type=int, default=5)
    ns = ap.parse_args(argv)
    worst = 0.0
    cases = [(name, env, None, ()) for name, env in BAD.items()]
    cases += [(name, {}, None, ("--extra-args-provider", spec)) for name, spec in BAD_PROVIDERS.items()]
    cases += [(name, {}, argv, ()) for name, argv in BAD_COMMANDS.items()]
    for name, env, command, extra in cases:
        runs = [sample(ns.megatron, env, command, extra) for _ in range(ns.repeats)]
        seconds = [s for s, _, _ in runs]
        codes = {c for _, c, _ in runs}
        worst = max(worst, max(seconds))
        print(f"{name:24} median {statistics.median(seconds):.3f} s, max {max(seconds):.3f} s, exit {sorted(codes)}: "
              f"{runs[0][2][:100]}")
    print(f"worst {worst:.3f} s against a target of {TARGET_S:.1f} s: {'met' if worst < TARGET_S else 'MISSED'}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
