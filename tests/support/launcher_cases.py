"""Real-Megatron cases of the launcher, patched checkouts and the safety net (the suite "launcher").

On the one driver (tree_driver.py): a patched copy of each tree and a copy with an injected rule
run first on the tree's worker, each after the worker drops the previous tree's modules; the
tree's own cases then run with every other suite's. ``run_cases`` runs any batch of cases on one
tree's worker. ``run_case`` is what the worker calls for a case of kind ``launcher`` (the
launcher's ``main``), ``cli`` (the command line's ``main``) or ``script`` (``python SCRIPT``).
Trees come from MEGATRON_LM_TREES only.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import operator
import os
import runpy
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import tree_driver

REPO = Path(__file__).resolve().parents[2]
TREES_ENV = tree_driver.TREES_ENV
SKIP_REASON = (f"{TREES_ENV} is unset: real-Megatron tests SKIPPED (set it to ':'-separated Megatron-LM "
               "checkouts, one per version; each needs Megatron-LM's Python requirements, see the README's "
               "'Plan your job')")

# Enough for parse_args + validate_args of pretrain_gpt.py on a CPU box, every version.
BASE_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--lr", "1e-4", "--train-iters", "1", "--bf16", "--vocab-size", "1000", "--mock-data",
    "--position-embedding-type", "rope", "--no-rope-fusion",
]
TOKENIZER = ["--tokenizer-type", "NullTokenizer"]
# GPT-3 175B's shape on one node of eight (TP 8): no H100 holds it, stock or planned (given after
# BASE_ARGS, its values are the ones argparse keeps).
DOES_NOT_FIT = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
                "--tensor-model-parallel-size", "8"]

PROVIDER_MODULE = "ptt_provider"
PROVIDER_SOURCE = '''\
"""Test providers: a user's own, a ModelOpt stand-in, and a ROCm-fork style combined provider."""


def add_my_flag(parser):
    parser.add_argument("--my-flag", type=int, default=None)
    return parser


def add_other(parser):
    parser.add_argument_group("ptt other").add_argument("--other-flag", action="store_true")
    return parser


def modelopt_standin(parser):
    group = parser.add_argument_group(title="modelopt stand-in")
    group.add_argument("--standin-flag", action="store_true")
    group.add_argument("--standin-default", default=None)  # filled from the script's args_defaults
    return parser


def rocm_patch_args(parser):
    parser.add_argument_group(title="rocm stand-in").add_argument("--rocm-standin-flag", action="store_true")
    return parser


def combined_args_provider(parser):
    import megatron_perf_toggles

    parser = modelopt_standin(parser)
    parser = rocm_patch_args(parser)
    return megatron_perf_toggles.extra_args_provider(parser)  # the plugin named again, inside
'''

# Calls Megatron the way this version's pretrain_gpt.py does (PTT_STYLE=upstream), or the way the
# ROCm fork does (PTT_STYLE=rocm: a combined provider, to parse_and_validate_args where it exists
# and to pretrain()).
MIMIC_SOURCE = '''\
import os

import ptt_provider
from megatron.training import arguments, pretrain

DEFAULTS = {"tokenizer_type": "NullTokenizer", "standin_default": "from-args-defaults"}
own = ptt_provider.modelopt_standin if os.environ["PTT_STYLE"] == "upstream" else ptt_provider.combined_args_provider
if hasattr(arguments, "parse_and_validate_args"):
    from megatron.training.arguments import parse_and_validate_args

    parse_and_validate_args(extra_args_provider=own, args_defaults=DEFAULTS)
    raise SystemExit("unreachable: a dry run exits inside parse_and_validate_args")
pretrain(None, None, None, None, args_defaults=DEFAULTS, extra_args_provider=own)
raise SystemExit("unreachable: a dry run exits inside initialize_megatron")
'''


trees, tree_id = tree_driver.trees, tree_driver.tree_id


def has_fused_field(tree: str) -> bool:
    """TransformerConfig.fused_single_qkv_rope exists from core 0.15 on."""
    path = Path(tree) / "megatron" / "core" / "transformer" / "transformer_config.py"
    return "fused_single_qkv_rope:" in path.read_text(encoding="utf-8")


def payload(result: dict[str, Any]) -> dict[str, Any]:
    """The dry run's JSON: stdout must hold it and nothing else."""
    assert result["error"] is None, result["error"]
    assert result["code"] == 0, result["stderr"][-3000:]
    return json.loads(result["stdout"])


def layout_cases(tree: str, work: Path) -> list[dict[str, Any]]:
    """NVIDIA's example layouts (tests/example_layouts.py), each planned with --world-size only."""
    from example_layouts import all_layouts

    script = str(Path(tree) / "pretrain_gpt.py")
    return [{"name": f"layout:{layout.name}", "mode": "launcher", "env": dict(layout.env),
             "argv": ["--dry-run", "--world-size", str(layout.world_size), script, *layout.argv]}
            for layout in all_layouts(str(work / "layouts"))]


def stock_cases(tree: str, work: Path) -> list[dict[str, Any]]:
    script = str(Path(tree) / "pretrain_gpt.py")
    mimic = str(work / "mimic_script.py")
    base = [*BASE_ARGS, *TOKENIZER]
    return [*layout_cases(tree, work),
        {"name": "plain", "mode": "launcher", "argv": ["--dry-run", script, *base]},
        # The same command line as a real launch and as a dry run, both planning for one machine (ASSUME).
        {"name": "real-launch", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20,cuda"},
         "argv": [str(work / "real_launch.py"), *base]},
        {"name": "real-launch-dry", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20,cuda"},
         "argv": ["--dry-run", script, *base]},
        {"name": "provider", "mode": "launcher",
         "env": {"MEGATRON_PERF_TOGGLES_DRY_RUN": "1", "GRAD_REDUCE_IN_BF16": "0"},
         "argv": ["--extra-args-provider", f"{PROVIDER_MODULE}:add_my_flag", script, *base, "--my-flag", "7",
                  f"--extra-args-provider={PROVIDER_MODULE}:add_other", "--other-flag"]},
        {"name": "unknown-flag", "mode": "launcher", "argv": ["--dry-run", script, *base, "--my-flag", "7"]},
        {"name": "cannot-honour", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "none"},
         # Both asked for by name for a machine without TE's kernel: nothing can yield, one line.
         "argv": ["--dry-run", script, *base, "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]},
        # MEGATRON_PERF_TOGGLES=0 is stock: the log directory stays as given.
        {"name": "stock-off-log-dir", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES": "0"},
         "argv": ["--dry-run", script, *base, "--tensorboard-dir", str(work / "tb")]},
        {"name": "no-fit", "mode": "launcher",
         "argv": ["--dry-run", "--fail-if-no-fit", "--world-size", "8", "--gpu", "h100", script, *base, *DOES_NOT_FIT]},
        # the default output (the summary holds this process's stderr for Megatron's file): the line still shows
        {"name": "no-fit-summary", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT": "summary"},
         "argv": ["--dry-run", "--fail-if-no-fit", "--world-size", "8", "--gpu", "h100", script, *base, *DOES_NOT_FIT]},
        {"name": "mimic-upstream", "mode": "launcher", "env": {"PTT_STYLE": "upstream"},
         "argv": ["--dry-run", "--extra-args-provider", "megatron_perf_toggles:extra_args_provider", mimic,
                  *BASE_ARGS, "--standin-flag"]},
        {"name": "mimic-rocm", "mode": "launcher", "env": {"PTT_STYLE": "rocm"},
         "argv": ["--dry-run", mimic, *BASE_ARGS, "--standin-flag", "--rocm-standin-flag"]},
    ]


def patched_cases(copy: str, fused: bool) -> list[dict[str, Any]]:
    script = str(Path(copy) / "pretrain_gpt.py")
    base = [*BASE_ARGS, *TOKENIZER]
    fused_flag = ["--fused-single-qkv-rope"] if fused else []
    dry = {"MEGATRON_PERF_TOGGLES_DRY_RUN": "1"}
    return [
        {"name": "patched-plugin", "mode": "script", "env": {**dry, "MEGATRON_PERF_TOGGLES_ASSUME": "te=2.8"},
         "argv": [script, *base, "--extra-args-provider", "megatron_perf_toggles",
                  f"--extra-args-provider={PROVIDER_MODULE}:add_my_flag", "--my-flag", "3", *fused_flag]},
        {"name": "patched-own-only", "mode": "script", "env": dry,
         "argv": [script, *base, "--extra-args-provider", f"{PROVIDER_MODULE}:add_my_flag", *fused_flag]},
        {"name": "patched-package-missing", "mode": "script", "env": dry,
         "block": ["megatron_perf_toggles.hooks"],
         "argv": [script, *base, "--extra-args-provider", "megatron_perf_toggles"]},
        {"name": "patched-no-fit", "mode": "script",
         "env": {**dry, "MEGATRON_PERF_TOGGLES_PLAN": "8:h100", "MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT": "1"},
         "argv": [script, *base, *DOES_NOT_FIT, "--extra-args-provider", "megatron_perf_toggles"]},
        {"name": "patched-unknown-arg", "mode": "script", "env": dry,
         "argv": [script, *base, "--extra-args-provider", "megatron_perf_toggles", "--no-such-flag", "3"]},
    ]


INJECTED_RULE = "injected test rule: no averaging in the collective"
INJECTED_CHATTER = "injected: validate_args output before the rule"
# Megatron prints before most of its asserts: the net must not show that output twice.
INJECTED_LINE = (f"    print({INJECTED_CHATTER!r}, flush=True)\n"
                 f"    assert not getattr(args, 'ddp_average_in_collective', False), {INJECTED_RULE!r}\n")
NET_SCRIPT = '''\
"""The plain provider path (no launcher): parse, validate and build the TransformerConfig."""
import json
import sys

import megatron_perf_toggles
from megatron.training import arguments

args = arguments.parse_args(extra_args_provider=megatron_perf_toggles.extra_args_provider)
arguments.validate_args(args, {})
arguments.core_transformer_config_from_args(args)
print("NET-RESULT " + json.dumps({"perf_toggles": args.perf_toggles,
                                  "ddp_average_in_collective": args.ddp_average_in_collective}))
'''


def inject_copy(tree: str, dest: Path) -> Path:
    """A copy of ``tree`` whose validate_args carries one rule Megatron does not have: it rejects
    ddp_average_in_collective, a plugin default. The safety net must find and back it off."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(Path(tree) / "megatron", dest / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        if (Path(tree) / name).exists():
            shutil.copy2(Path(tree) / name, dest / name)
    path = dest / "megatron" / "training" / "arguments.py"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("def validate_args("))
    lines.insert(at + 1, INJECTED_LINE)
    path.write_text("".join(lines), encoding="utf-8")
    (dest / "net_script.py").write_text(NET_SCRIPT)
    return dest


def net_cases(copy: str) -> list[dict[str, Any]]:
    script = str(Path(copy) / "pretrain_gpt.py")
    base = [*BASE_ARGS, *TOKENIZER]
    return [
        {"name": "net-launcher", "mode": "launcher", "argv": ["--dry-run", script, *base]},
        {"name": "net-provider", "mode": "script", "argv": [str(Path(copy) / "net_script.py"), *base]},
        {"name": "net-env-explicit", "mode": "launcher", "env": {"DDP_AVERAGE_IN_COLLECTIVE": "1"},
         "argv": ["--dry-run", script, *base]},
        {"name": "net-cli-explicit", "mode": "launcher",
         "argv": ["--dry-run", script, *base, "--ddp-average-in-collective"]},
        {"name": "net-stock-off", "mode": "launcher", "env": {"MEGATRON_PERF_TOGGLES": "0"},
         "argv": ["--dry-run", script, *base]},
    ]




# A real launch, as far as a CPU machine can take one: Megatron's own parse and validate with the
# launcher's hooks in place and no dry run, then the decisions the run would train with, as JSON.
REAL_LAUNCH_SOURCE = '''\
import json

from megatron.training import arguments

args = arguments.parse_args()
arguments.validate_args(args, {})
keep = ("tensor_model_parallel_size", "data_parallel_size", "accumulate_allreduce_grads_in_fp32", "world_size")
print("REAL-LAUNCH " + json.dumps({"decisions": args.perf_toggles, "precision": args.perf_toggles_precision,
                                   "derived": {k: getattr(args, k, None) for k in keep}}, default=str))
'''


def _prepare(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{PROVIDER_MODULE}.py").write_text(PROVIDER_SOURCE)
    (work / "mimic_script.py").write_text(MIMIC_SOURCE)
    (work / "real_launch.py").write_text(REAL_LAUNCH_SOURCE)


def patch_copy(tree: str, dest: Path) -> Path:
    """A copy of ``tree`` with its patch set applied through the real command line, in a process
    of its own (this runs beside the unit tests: nothing here may print into theirs)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(tree, dest, ignore=shutil.ignore_patterns("__pycache__", ".git", "tests", "docs", "examples"))
    done = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "patch", "--megatron", str(dest)],
                          env=tree_driver.driver_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"patching a copy of {tree} failed: {done.stderr[-2000:]}"
    return dest


_COPIES: dict[str, Path | BaseException] = {}
_COPY_LOCKS: dict[str, threading.Lock] = {}


def patched(tree: str) -> Path:
    """The session's patched copy of ``tree``, made once (or failed once) for every suite that runs
    cases on it; trees are copied in parallel."""
    key = str(Path(tree).resolve())
    lock = _COPY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _COPIES:
            try:
                _COPIES[key] = patch_copy(tree, tree_driver.SESSION.work(tree) / "patched" / tree_id(tree))
            except Exception as error:  # noqa: BLE001 - each suite that needs the copy reports it
                _COPIES[key] = error
        found = _COPIES[key]
    if isinstance(found, BaseException):
        raise AssertionError(f"the patched copy of {tree} could not be made: {found}")
    return found


def _build(tree: str, work: Path) -> list[dict[str, Any]]:
    """The launcher suite's phases on one tree: the tree itself, a patched copy, an injected copy."""
    _prepare(work.parent)  # the worker's directory, on its sys.path: the provider module and scripts
    copy = patched(tree)
    injected = inject_copy(tree, work / "injected" / tree_id(tree))
    return [
        {"tree": tree, "cases": stock_cases(tree, work.parent)},
        {"tree": str(copy), "cases": patched_cases(str(copy), has_fused_field(tree))},
        {"tree": str(injected), "cases": net_cases(str(injected))},
    ]


SUITE = tree_driver.SESSION.suite("launcher", _build, owners=("test_launcher", "test_patches", "test_safety_net"))


def run_cases(tree: str, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``cases`` on ``tree``'s worker, which has Megatron imported already: how a test runs many
    dry runs of one tree (e.g. every arm of an ablation) without starting a process for each."""
    return tree_driver.SESSION.run(tree, cases)


def cli_on_worker(tree: str | os.PathLike[str], argv: list[str], env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess[str]:
    """``python -m megatron_perf_toggles ARGV`` as its ``main`` on ``tree``'s worker, answered as a
    finished process would be (exit code, stdout, stderr)."""
    found = run_cases(str(tree), [{"name": "cli", "mode": "cli", "env": dict(env or {}), "argv": list(argv)}])["cli"]
    assert found["error"] is None, found["error"]
    return subprocess.CompletedProcess(argv, found["code"], found["stdout"], found["stderr"])


def arm_resolver(tree: str | os.PathLike[str]) -> Any:
    """A resolver for ablate (as ``resolve_arm``): each arm's dry run on ``tree``'s worker, as rank
    0, in the arm's environment; a failed dry run raises the ConfoundError ``resolve_arm`` would."""
    from megatron_perf_toggles.tools.ablate import runs as ablate

    def resolver(script: str, args: list[str], arm: Any, environ: dict[str, str], world: int | None = None
                 ) -> dict[str, Any]:
        from sandbox import plugin_part

        plugin_env = plugin_part(environ, "CUDA_DEVICE")
        case = {"name": "arm", "mode": "launcher", "argv": ablate.dry_run_command(script, args, arm, world)[3:],
                "env": {**plugin_env, **arm.env, "RANK": "0"}}
        return arm_record(run_cases(str(tree), [case])["arm"], arm)

    return resolver


def arm_record(result: dict[str, Any], arm: Any) -> dict[str, Any]:
    """An arm's dry-run record from its case's result; a failed dry run raises the ConfoundError
    ablate's own ``resolve_arm`` would."""
    from megatron_perf_toggles.tools.ablate import confounds as ablate

    assert not result["error"], f"arm {arm.name}: {result['error']}"
    if result["code"] != 0:
        tail = " | ".join(result["stderr"].strip().splitlines()[-3:])
        raise ablate.ConfoundError(f"arm {arm.name}: the dry run failed (exit {result['code']}): {tail}")
    return json.loads(result["stdout"])


def results(tree: str) -> dict[str, dict[str, Any]]:
    """Every case's result for ``tree`` (waits for the tree's worker)."""
    return tree_driver.SESSION.results(SUITE, tree)


# --- in the worker -----------------------------------------------------------------------------------


_MISSING = object()


_ARCH_ORIGINAL: dict[str, Any] = {}


def _plan_device_arch(major: int | None) -> None:
    """Let validate_args see a GPU of compute-capability ``major`` where it asks for one (TP/CP > 1,
    Megatron-FSDP): the machine the case plans for. ``None`` puts Megatron's function back."""
    arguments = sys.modules.get("megatron.training.arguments")
    if major is None:
        if arguments is not None and "fn" in _ARCH_ORIGINAL:
            arguments.get_device_arch_version = _ARCH_ORIGINAL.pop("fn")
        return
    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    with megatron_importable():
        from megatron.training import arguments
    _ARCH_ORIGINAL.setdefault("fn", arguments.get_device_arch_version)
    arguments.get_device_arch_version = lambda: major


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One launcher or script case, in the worker (tree_driver)."""
    import torch

    from megatron_perf_toggles.launcher import launch as run
    from megatron_perf_toggles.launcher.import_shims import megatron_importable
    from megatron_perf_toggles.runtime import safety_net
    from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

    device_queries = {name: getattr(torch.cuda, name) for name in (
        "is_available", "device_count", "get_device_capability", "get_device_properties")}
    versions = (torch.version.cuda, torch.version.hip)
    # the dry run's import stand-ins and uncompiled torch.compile (launcher/import_shims.py)
    shims = (builtins.__import__, torch.compile, torch.compiler.disable)

    out, err = io.StringIO(), io.StringIO()
    saved = (sys.stdout, sys.stderr, list(sys.argv), list(sys.path), dict(os.environ))
    blocked = {name: sys.modules.get(name, _MISSING) for name in case.get("block", [])}
    for name in case.get("unset", []):
        os.environ.pop(name, None)
    os.environ.update(case.get("env", {}))
    if case["mode"] != "cli" and "MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT" not in case.get("unset", []):
        os.environ.setdefault("MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT", "json")  # the record on stdout, for the checks
    world_vars = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    world_before = {v: os.environ.get(v) for v in world_vars}
    world_after: dict[str, Any] = {}
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` fail
    code: Any = None
    error = None
    started = time.perf_counter()
    sys.stdout, sys.stderr = out, err
    undo = contextlib.ExitStack()
    undo.enter_context(PROCESS_CHANGES.scope())  # what the run changes through PROCESS_CHANGES (hooks, net) is undone
    try:
        tree_driver.plan_te_version(case.get("te_version"))
        _plan_device_arch(case.get("device_arch"))
        if case["mode"] == "launcher":  # as `python -m megatron_perf_toggles.run ARGV`
            code = run.main(case["argv"])
        elif case["mode"] == "cli":  # as `python -m megatron_perf_toggles ARGV`
            from megatron_perf_toggles.tools import cli

            sys.argv = ["megatron-perf-toggles", *case["argv"]]  # its messages name the program as users run it
            code = cli.main(case["argv"])
        else:  # as `python SCRIPT ARGS`
            sys.argv = list(case["argv"])
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            with megatron_importable():
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
    except SystemExit as done:
        if isinstance(done.code, str):
            err.write(done.code + "\n")
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported to the test
        error = traceback.format_exc()
    finally:
        sys.stdout, sys.stderr = saved[0], saved[1]
        sys.argv, sys.path[:] = saved[2], saved[3]
        world_after = {v: os.environ.get(v) for v in world_vars}
        os.environ.clear()
        os.environ.update(saved[4])
        for name, module in blocked.items():
            if module is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module  # type: ignore[assignment]
        undo.close()
        safety_net.NET.uninstall()
        tree_driver.plan_te_version(None)
        _plan_device_arch(None)
    undone = (all(getattr(torch.cuda, name) is fn for name, fn in device_queries.items())
              and (torch.version.cuda, torch.version.hip) == versions
              and all(map(operator.is_, (builtins.__import__, torch.compile, torch.compiler.disable), shims))
              and world_after == world_before)
    return {"name": case["name"], "argv": case["argv"], "code": code, "stand_ins_undone": undone,
            "stdout": out.getvalue(), "stderr": err.getvalue(), "error": error,
            "seconds": round(time.perf_counter() - started, 2)}
