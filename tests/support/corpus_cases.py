"""Megatron's real parse_args + validate_args + TransformerConfig, stock and with the plugin, for a
batch of command lines (kind ``corpus``: functional-test configs or fuzz samples) on a tree's worker
(tree_driver.py), each in every mode:

- ``A``: stock Megatron, no extra_args_provider at all;
- ``B``: the plugin with ``MEGATRON_PERF_TOGGLES=0`` (on the same assumed machine as C1);
- ``C1``: plugin defaults on an assumed GPU box (APEX, Transformer Engine, CUDA);
- ``C2``: plugin defaults with nothing installed.

Where Megatron asks the device (compute capability, device properties, the Transformer Engine
version), the batch answers like an H100 (sm_90) with the batch's TE version installed, without
touching a GPU, and puts the real answers back when it ends. Each case gets a fresh argv,
environment, temporary directories and torch determinism flag; Megatron's module-level globals
are put back after every case.

Stock mode calls the functions captured before the plugin ran (Megatron's own); plugin modes look
``parse_args``, ``validate_args`` and ``core_transformer_config_from_args`` up on Megatron's
``arguments`` module at call time, so whatever wrapper the plugin installs there is what runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

import tree_driver

# The TE version the assumed GPU box has (the parent reads PTT_TE_VERSION and puts it in the batch).
TE_VERSION = "2.12.0"


def mode_env(te_version: str) -> dict[str, dict[str, str]]:
    """Each mode's plugin variables, for a GPU box with ``te_version``."""
    gpu_box = f"apex,te={te_version},cuda"
    return {
        "A": {},
        "B": {"MEGATRON_PERF_TOGGLES": "0", "MEGATRON_PERF_TOGGLES_ASSUME": gpu_box},
        "C1": {"MEGATRON_PERF_TOGGLES_ASSUME": gpu_box},
        "C2": {"MEGATRON_PERF_TOGGLES_ASSUME": "none"},
    }
NET_WORDS = "found at run time"
# The plugin's error lines (megatron_perf_toggles.errors.PREFIX).
PLUGIN_PREFIX = "[perf-toggles]"


class _H100Properties:
    """What torch.cuda.get_device_properties answers on an H100 SXM."""

    name = "NVIDIA H100 80GB HBM3"
    major = 9
    minor = 0
    total_memory = 80 * 1024**3
    multi_processor_count = 132
    is_integrated = False
    uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return f"_CudaDeviceProperties(name='{self.name}', major=9, minor=0)"


def answer_like_a_gpu_machine(te_version: str, patches: Any) -> None:
    """Make Megatron's device and Transformer Engine probes see an H100 with ``te_version``
    installed, through ``patches`` (a ProcessChanges: undone when the batch ends).

    Only the probes validate_args and TransformerConfig use are answered; torch.cuda.is_available
    stays as it is, so nothing tries to create a CUDA context.
    """
    import torch

    patches.set_attr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    patches.set_attr(torch.cuda, "get_device_properties", lambda device=None: _H100Properties())
    patches.set_attr(torch.cuda, "device_count", lambda: 8)
    patches.set_attr(torch.cuda, "get_device_name", lambda device=None: _H100Properties.name)
    tree_driver.plan_te_version(te_version)
    # TransformerConfig checks that TE's fused kernels imported (RoPE, MoE permutation): without TE
    # these module attributes are None (or, on older trees, missing). A stand-in answers "present";
    # nothing here calls it.
    for name, attrs in TE_KERNEL_PROBES.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in attrs:
            if getattr(module, attr, None) is None:
                patches.set_attr(module, attr, _te_kernel_stand_in)


TE_KERNEL_PROBES = {
    "megatron.core.models.common.embeddings.rope_utils": ("fused_apply_rotary_pos_emb",
                                                          "fused_apply_rotary_pos_emb_thd"),
    "megatron.core.transformer.moe.moe_utils": ("fused_permute", "fused_permute_with_probs", "fused_unpermute",
                                                "fused_sort_chunks_by_index",
                                                "fused_sort_chunks_by_index_with_probs"),
}


def _te_kernel_stand_in(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a Transformer Engine kernel stand-in was called: only its presence is answered")


# --- isolation ------------------------------------------------------------------------------------


_GLOBAL_MODULES = ("megatron.training.global_vars", "megatron.core.parallel_state", "megatron.core.utils",
                   "megatron.training.utils", "megatron.training.utils.common_utils")


def _global_snapshot() -> dict[str, dict[str, Any]]:
    """Module-level variables of the Megatron modules that keep process-wide state."""
    out: dict[str, dict[str, Any]] = {}
    for name in _GLOBAL_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = {k: v for k, v in vars(module).items()
                         if not k.startswith("__") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}
    return out


def _global_restore(snapshot: dict[str, dict[str, Any]]) -> None:
    for name, values in snapshot.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in values.items():
            if vars(module).get(key, value) is not value:
                setattr(module, key, value)


def _clean_environ(base: dict[str, str], extra: dict[str, str]) -> None:
    from sandbox import sandbox_os_environ

    sandbox_os_environ(base, extra)


def _fresh_dirs(dirs: list[str]) -> None:
    """Empty directories behind the placeholders: no mode sees what an earlier mode wrote."""
    for d in dirs:
        if os.path.isdir(d) and not os.listdir(d):
            continue  # removing and re-creating costs more than the look (slow overlay filesystems)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, exist_ok=True)


# --- one mode of one command line -----------------------------------------------------------------


def _error_line(exc: BaseException) -> str:
    """``Type: first line of the message (file:line)`` at the frame that raised it."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = ""
    for frame in reversed(tb):
        if "/megatron/" in frame.filename or "megatron_perf_toggles" in frame.filename:
            parts = Path(frame.filename).parts
            anchor = "megatron_perf_toggles" if "megatron_perf_toggles" in parts else "megatron"
            where = f" ({'/'.join(parts[parts.index(anchor):])}:{frame.lineno})"
            break
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}{where}"


def _exit_line(code: Any, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(PLUGIN_PREFIX) and "error" in ln:
            return f"SystemExit({code}): {ln[:400]}"
    for ln in reversed(lines):
        if "error:" in ln:
            return f"SystemExit({code}): {ln[:400]}"
    if isinstance(code, str):
        return f"SystemExit: {code.strip().splitlines()[0][:400] if code.strip() else ''}"
    return f"SystemExit({code}): {lines[-1][:400] if lines else ''}"


def run_mode(mode: str, argv: list[str], env: dict[str, str], api: dict[str, Any], base_env: dict[str, str],
             dirs: list[str], want_config: bool = True, explicit: list[str] = ()) -> tuple[dict[str, Any], Any]:
    """Parse, validate and build the TransformerConfig once; returns (result, namespace or None)."""
    import torch

    from megatron_perf_toggles import extra_args_provider
    from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

    _clean_environ(base_env, {**env, **api["mode_env"][mode]})
    _fresh_dirs(dirs)
    sys.argv = ["pretrain_gpt.py", *argv]
    arguments = api["module"]
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, Any] = {"ok": False, "stage": "parse"}
    args = None
    deterministic = torch.are_deterministic_algorithms_enabled()
    snapshot = _global_snapshot()
    dist = getattr(torch, "distributed", None)
    init_pg = getattr(dist, "init_process_group", None)
    api["te_reset"]()
    undo = contextlib.ExitStack()
    undo.enter_context(PROCESS_CHANGES.scope())  # the plugin's wrappers, if it installs any, are undone after
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "A":
                args = api["parse_args"](extra_args_provider=None)
                result["stage"] = "validate"
                api["validate_args"](args, {})
                if want_config:
                    result["stage"] = "config"
                    api["core_transformer_config_from_args"](args)
            else:
                # Looked up at call time: the plugin's wrappers, if it installs any, are used.
                args = arguments.parse_args(extra_args_provider=extra_args_provider)
                result["stage"] = "validate"
                arguments.validate_args(args, {})
                if want_config:
                    result["stage"] = "config"
                    arguments.core_transformer_config_from_args(args)
        result["ok"] = True
        result["stage"] = "done"
    except SystemExit as exc:
        result["error"] = _exit_line(exc.code, err.getvalue())
        result["exit_code"] = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        result["error"] = _error_line(exc)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        _global_restore(snapshot)
        if dist is not None and init_pg is not None:
            dist.init_process_group = init_pg
        undo.close()
    if args is not None and hasattr(args, "perf_toggles"):
        result["perf_toggles"] = args.perf_toggles
        result["net"] = sorted(d for d, rec in args.perf_toggles.items() if NET_WORDS in str(rec.get("reason", "")))
        from megatron_perf_toggles.core.registry import TOGGLES

        result["final"] = {t.dest: getattr(args, t.dest, None) for t in TOGGLES}
    elif args is not None:
        from megatron_perf_toggles.core.registry import TOGGLES

        result["final"] = {t.dest: getattr(args, t.dest, None) for t in TOGGLES}
    if args is not None:
        # What the command line asked for, as it ended after validate_args (text: JSON-safe, comparable).
        result["explicit"] = {dest: repr(getattr(args, dest, None)) for dest in explicit}
    if not result["ok"]:
        result["stderr_tail"] = err.getvalue()[-1500:]
    return result, args


# --- comparing B with A ---------------------------------------------------------------------------

# What the plugin adds to the namespace even with MEGATRON_PERF_TOGGLES=0: its own record (docs/guards.md).
# It changes nothing of Megatron's: --tensorboard-dir and --wandb-save-dir stay as given, untagged.
ALLOWED_B_DIFFERENCES = frozenset({"perf_toggles", "perf_toggles_precision"})
# What the plugin, switched on, documents it changes besides the toggles: the log directories, tagged
# with the precision (README). Off (B), they stay as given.
TAGGED_WHEN_ON = frozenset({"tensorboard_dir", "wandb_save_dir"})


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors, odd objects: compare their text
        return repr(a) == repr(b)


def namespace_diff(a: Any, b: Any) -> list[str]:
    """Attributes where B differs from A, minus the documented ones.

    An attribute only B has is allowed when it is a toggle dest this Megatron's parser lacks
    (the plugin registers its flag) and B holds Megatron's own default for it.
    """
    from megatron_perf_toggles.core.registry import TOGGLES

    stock_defaults = {t.dest: t.stock_default for t in TOGGLES}
    va, vb = vars(a), vars(b)
    out = []
    for key in sorted(set(va) | set(vb)):
        if key in ALLOWED_B_DIFFERENCES:
            continue
        if key not in va:
            if key in stock_defaults and _same(vb[key], stock_defaults[key]):
                continue
            out.append(f"{key}: only with the plugin ({vb[key]!r})")
        elif key not in vb:
            out.append(f"{key}: missing with the plugin (stock {va[key]!r})")
        elif not _same(va[key], vb[key]):
            out.append(f"{key}: stock {va[key]!r}, plugin {vb[key]!r}")
    return out


# --- cases ----------------------------------------------------------------------------------------


def run_case_modes(case: dict[str, Any], api: dict[str, Any], base_env: dict[str, str]) -> dict[str, Any]:
    """Every mode of one command line. B and C run only where A accepts (nothing to hold otherwise)."""
    started = time.perf_counter()
    dirs = case.get("dirs", [])
    modes = case.get("modes", ["A", "B", "C1", "C2"])
    out: dict[str, Any] = {"id": case["id"], "modes": {}}
    explicit = explicit_dests(case["argv"], api["dests"])
    a_result, a_args = run_mode("A", case["argv"], case.get("env", {}), api, base_env, dirs, explicit=explicit)
    out["modes"]["A"] = a_result
    if a_result["ok"]:
        for mode in modes:
            if mode == "A":
                continue
            result, args = run_mode(mode, case["argv"], case.get("env", {}), api, base_env, dirs, explicit=explicit)
            if mode == "B" and result["ok"]:
                result["diff"] = namespace_diff(a_args, args)
            out["modes"][mode] = result
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


def option_dests(api: dict[str, Any], base_env: dict[str, str]) -> dict[str, str]:
    """Every option string of this tree's stock pretrain parser and its dest, captured through a
    provider that adds nothing."""
    found: dict[str, str] = {}

    def capture(parser: Any) -> Any:
        found.update({flag: action.dest for flag, action in parser._option_string_actions.items()})
        return parser

    _clean_environ(base_env, {})
    sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
                "--global-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        api["parse_args"](extra_args_provider=capture)
    return found


def explicit_dests(argv: list[str], dests: dict[str, str]) -> list[str]:
    """Dests the command line sets itself (flags named on it), minus what the plugin documents it
    adds or changes (its record; with it on, the precision-tagged log directories)."""
    named = {dests[w.split("=", 1)[0]] for w in argv if w.startswith("--") and w.split("=", 1)[0] in dests}
    return sorted(named - ALLOWED_B_DIFFERENCES - TAGGED_WHEN_ON)


def cache_megatron_facts(patches: Any) -> None:
    """The plugin reads this tree's facts (version, TransformerConfig fields) from source on every
    parse (~0.1 s); they cannot change within the batch, so they are read once (through
    ``patches``: the batch's end puts the uncached function back)."""
    import functools

    from megatron_perf_toggles.runtime.machine import capabilities

    original = capabilities.megatron_facts
    if not getattr(original, "cache_info", None) and not inspect_params(original):
        patches.set_attr(capabilities, "megatron_facts", functools.cache(original))


def inspect_params(fn: Any) -> bool:
    import inspect

    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True


def run_case(batch: dict[str, Any]) -> dict[str, Any]:
    """One batch in the worker: ``batch["cases"]`` (functional-test configs) or ``batch["fuzz"]``
    (seed, count, workdir: the samples are generated here, from this tree's flags)."""
    from megatron_perf_toggles.launcher.import_shims import megatron_importable
    from megatron_perf_toggles.runtime.process_changes import ProcessChanges

    saved_argv, base_env = list(sys.argv), dict(os.environ)
    started = time.perf_counter()
    with megatron_importable():
        from megatron.core import package_info
        from megatron.training import arguments
    import_seconds = time.perf_counter() - started
    tree_driver.assert_megatron_unwrapped(arguments)
    te_version = batch.get("te_version") or TE_VERSION
    patches = ProcessChanges()
    answer_like_a_gpu_machine(te_version, patches)
    cache_megatron_facts(patches)

    def te_reset() -> None:
        tree_driver.plan_te_version(te_version)

    api = {
        "module": arguments,
        "parse_args": arguments.parse_args,
        "validate_args": arguments.validate_args,
        "core_transformer_config_from_args": arguments.core_transformer_config_from_args,
        "te_reset": te_reset,
        "mode_env": mode_env(te_version),
    }
    payload: dict[str, Any] = {"version": package_info.__version__, "te_version": te_version,
                               "import_seconds": round(import_seconds, 2), "results": []}
    try:
        with megatron_importable():
            api["dests"] = option_dests(api, base_env)
            if batch.get("fuzz"):
                import megatron_fuzz

                fuzz = batch["fuzz"]
                cases = megatron_fuzz.generate(fuzz["seed"], fuzz["count"], sorted(api["dests"]), fuzz["workdir"])
                payload["samples"] = cases
            else:
                cases = batch["cases"]
            for case in cases:
                try:
                    payload["results"].append(run_case_modes(case, api, base_env))
                except BaseException as exc:  # noqa: BLE001 - one broken case must not hide the others
                    payload["results"].append({"id": case["id"], "driver_error": _error_line(exc)})
    finally:
        patches.uninstall()
        tree_driver.plan_te_version(None)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(base_env)
    payload["seconds"] = round(time.perf_counter() - started, 2)
    return payload
