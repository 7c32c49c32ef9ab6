"""Parity with the originating launch script (ROCm/Megatron-LM examples/llama/train_llama3.sh, PR 141).

tests/fixtures/originating_script_parity.json holds, as facts, what that script hands Megatron for
each environment (toggle values, FP4 layer selection, log directory) and, where the plugin
deliberately differs, what it does instead and why. Each environment goes through this project's
examples/llama/train_llama3.sh (same variables as the originating script) to a command line, then:

- on every real tree in MEGATRON_LM_TREES: the launcher's dry run (Megatron's own parse and
  validate), all environments on the tree's worker (tests/tree_driver.py);
- on the recorded ROCm fork surface: the plugin on the replayed parser (what
  ``explain --megatron-version rocm_fork`` runs).

The plan is a machine with APEX, Transformer Engine 2.20 and 8 Hopper-class GPUs per node
(MEGATRON_PERF_TOGGLES_ASSUME for the plugin; Megatron's own TE version and device checks see the same).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import launcher_cases as runs
import pytest
import tree_driver
from conftest import REPO

from megatron_perf_toggles.core.decision.decide import FP4_RECIPE_SELECTION
from megatron_perf_toggles.core.registry import SETTINGS, TOGGLES
from megatron_perf_toggles.errors import PREFIX, PerfTogglesError

FACTS = json.loads((REPO / "tests" / "fixtures" / "originating_script_parity.json").read_text())
CASES = FACTS["cases"]
RULES = {r["id"]: r for r in FACTS["version_differences"]}
EXAMPLE = REPO / "examples" / "llama" / "train_llama3.sh"
TIME_STAMP = "2025-01-01_00-00-00"
PLANNED = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20", "WORLD_SIZE": "8", "RANK": "0"}
TE_PLANNED = "2.20.0"
DEVICE_ARCH_PLANNED = 9  # a Hopper-class GPU, for validate_args' questions about the device
TOGGLE_DESTS = [t.dest for t in TOGGLES]
FP4_DESTS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
SCRIPT = "<MEGATRON_LM>/pretrain_gpt.py"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not available")


# --- the facts table itself -----------------------------------------------------------------------


def test_the_table_covers_what_the_parity_check_needs():
    envs = [{k: v for k, v in c["env"].items() if k != "TP"} for c in CASES]  # TP=1: see the table's "about"
    assert len(CASES) >= 40 and len({c["id"] for c in CASES}) == len(CASES)
    for t in (t for t in TOGGLES if t.scope == "all"):  # every toggle at 0 and 1 (and unset: the precision cases);
        # the originating script launches a dense Llama-3, where the MoE toggles leave Megatron's values
        for word in (("0", "1") if t.kind == "bool" else ("native", "te")):
            assert {t.env: word} in envs, (t.env, word)
    for env in ({}, {"TE_FP8": "1"}, {"TE_FP8": "1", "TE_FP8_RECIPE": "tensorwise"},
                {"TE_FP8": "1", "TE_FP8_RECIPE": "mxfp8"}, {"TE_FP4": "1"}, {"TE_FP4": "1", "TE_FP4_RECIPE": "mxfp4"}):
        assert env in envs
    assert any("FSDP" in e for e in envs) and any("MEGATRON_FSDP" in e for e in envs)
    assert sum("LOG_DIR" in e for e in envs) >= 3


def test_every_deliberate_difference_has_a_reason_and_is_in_the_docs():
    section = (REPO / "docs" / "parity.md").read_text()
    for case in CASES:
        if "plugin" in case and ("values" in case["plugin"] or "fp4_layers" in case["plugin"]
                                 or "tensorboard_dir" in case["plugin"] or "error" in case["plugin"]):
            assert case.get("difference"), case["id"]
            assert f"`{case['id']}`" in section, f"docs/parity.md lacks {case['id']}"
    for rule in RULES:
        assert f"`{rule}`" in section, f"docs/parity.md lacks {rule}"


# --- the project's example keeps the script's user interface --------------------------------------


def _example_defaults() -> dict[str, str]:
    """``NAME=${NAME:-DEFAULT}`` assignments of the example, as written."""
    text = EXAMPLE.read_text()
    found = {}
    for name, default in re.findall(r"^\s*(?:export\s+)?([A-Z0-9_]+)=\$\{\1:-(.*?)\}\s*(?:#.*)?$", text, re.M):
        found[name] = default
    return found


def test_example_keeps_the_scripts_variables_and_defaults():
    variables = FACTS["interface"]["variables"]
    defaults = _example_defaults()
    text = EXAMPLE.read_text()
    plugin_vars = {t.env for t in TOGGLES} | {"FP4_SELECTIVE_BF16", "FP4_BF16_START", "FP4_BF16_END"}
    settings = {s.env: s for s in SETTINGS}
    for name, expected in variables.items():
        if name in plugin_vars:
            # Read by the plugin itself, with the script's defaults; the example must not set them.
            assert name not in defaults, f"the example sets {name}, which the plugin reads"
            if name == "FP4_SELECTIVE_BF16":
                assert {r: str(int(sel[0])) for r, sel in FP4_RECIPE_SELECTION.items()} == expected
            elif name in settings:
                assert str(settings[name].default) == expected, name
            else:
                toggle = next(t for t in TOGGLES if t.env == name)
                assert (str(int(toggle.default)) if toggle.kind == "bool" else toggle.default) == expected, name
        elif name == "LOG_DIR":
            assert re.sub(r"\$\{(\w+)\}", r"{\1}", defaults["LOG_DIR"]) == expected
        elif expected is None:
            assert re.search(rf"\b{name}\b", text), f"the example ignores {name}"
        else:
            assert defaults.get(name) == expected, (name, defaults.get(name), expected)
    assert FACTS["interface"]["key_value_arguments"] and 'export "${ARGUMENT%%=*}=' in text


def _example(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in tree_driver.SESSION.environ.items()  # as the session started: builds run beside tests
            if k in ("PATH", "HOME", "LANG", "TMPDIR") or k.startswith("LC_")}
    full = {**base, "MEGATRON_LM": "<MEGATRON_LM>", "PRINT_ONLY": "1", "TIME_STAMP": TIME_STAMP,
            "GPUS_PER_NODE": "8", "PYTHON": sys.executable, **extra, **env}
    return subprocess.run(["bash", str(EXAMPLE)], env=full, capture_output=True, text=True, timeout=60, check=False)


def test_example_takes_key_value_arguments():
    proc = subprocess.run(["bash", str(EXAMPLE), "MODEL_SIZE=8", "TP=2"], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "MEGATRON_LM": "/m", "PRINT_ONLY": "1", "GPUS_PER_NODE": "8"})
    assert proc.returncode == 0, proc.stderr
    assert "--num-layers 32" in proc.stdout and "--tensor-model-parallel-size 2" in proc.stdout


@cache
def example_command(case_id: str) -> tuple[list[str] | None, str]:
    """(Megatron's arguments, the example's stderr); None when the example refuses the environment."""
    case = next(c for c in CASES if c["id"] == case_id)
    proc = _example(case["env"])
    if proc.returncode != 0:
        assert proc.returncode == 2, proc.stderr
        return None, proc.stderr
    words = shlex.split(proc.stdout)
    return words[words.index(SCRIPT) + 1:], proc.stderr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_example_passes_the_scripts_precision_and_fsdp_flags(case):
    argv, _err = example_command(case["id"])
    if "error" in case["script"]:
        return
    joined = " ".join(argv)
    for flag in case["script"]["precision_flags"]:
        assert flag in joined, flag
    assert f"--tensorboard-dir {case['script']['tensorboard_dir'].format(TIME_STAMP=TIME_STAMP)}" in joined


# --- what each target should give -----------------------------------------------------------------


def _version(tree: Path) -> tuple[int, ...]:
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    return tuple(int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))


def expected(case: dict[str, Any], version: tuple[int, ...] | None) -> dict[str, Any]:
    """The table's answer for one target: ``version`` None is the ROCm fork, else an upstream core."""
    plugin = case.get("plugin", {})
    if "error" in plugin:
        return {"error": plugin["error"]}
    script = case["script"]
    out = copy.deepcopy({k: script[k] for k in ("values", "fp4_layers", "tensorboard_dir", "tag")})
    out["values"].update(plugin.get("values", {}))
    for key in ("fp4_layers", "tensorboard_dir", "warning"):
        if key in plugin:
            out[key] = plugin[key]
    env = case["env"]
    if version is not None:
        if env.get("TE_FP4") == "1" and version < (0, 15):
            return dict(RULES["fp4_needs_core_0_15"]["expect"])
        if env.get("TE_FP4") == "1" and env.get("TE_FP4_RECIPE") == "mxfp4":
            return dict(RULES["mxfp4_needs_the_fork"]["expect"])
        if env.get("MEGATRON_FSDP") == "1" and version < (0, 14):
            return dict(RULES["megatron_fsdp_needs_core_0_14"]["expect"])
        if version < (0, 15):
            out["values"].update(RULES["fused_rope_needs_the_field"]["expect"]["values"])
        v = out["values"]
        if version >= (0, 18, 2) and v["cross_entropy_loss_fusion"] and v["cross_entropy_fusion_impl"] == "te":
            v.update(RULES["te_cross_entropy_asserted"]["expect"]["values"])
    return out


def compare(case: dict[str, Any], want: dict[str, Any], code: int, args: dict[str, Any] | None,
            messages: list[str], stderr: str) -> None:
    if "error" in want:
        by, says = want["error"]["by"], want["error"]["says"]
        assert code == 2, (code, stderr[-1500:])
        if by == "plugin":
            assert f"[perf-toggles] error: {says}" in stderr and "Traceback" not in stderr, stderr[-1500:]
        else:
            assert says in stderr, stderr[-1500:]
        return
    assert code == 0 and args is not None, stderr[-3000:]
    for dest, value in want["values"].items():
        if value is None:  # the script passes nothing for it (unused)
            continue
        assert args[dest] == value, (dest, args[dest], value)
    if want["fp4_layers"] is not None:
        defaults = FACTS["megatron_defaults"]
        layers = [want["fp4_layers"][0]] + [defaults[d] if n is None else n
                                           for d, n in zip(FP4_DESTS[1:], want["fp4_layers"][1:], strict=True)]
        assert [args[d] for d in FP4_DESTS] == layers
    assert args["perf_toggles_precision"] == want["tag"]
    assert args["tensorboard_dir"] == want["tensorboard_dir"].format(TIME_STAMP=TIME_STAMP)
    if "warning" in want:
        assert any(want["warning"] in m for m in messages), messages


# --- the ROCm fork surface ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_parity_on_the_fork_surface(case, capsys):
    from megatron_perf_toggles.tools import cli

    argv, err = example_command(case["id"])
    want = expected(case, None)
    if argv is None:
        assert want.get("error", {}).get("by") == "example", err
        assert want["error"]["says"] in err
        return
    code, args, messages = 0, None, []
    try:
        plan, _caps, _label, args, _launch = cli.plan_command_line(argv, surface="rocm_fork", environ={**case["env"], **PLANNED})
        messages = [m.text for m in plan.messages]
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 2
    except PerfTogglesError as error:  # what `explain` prints for it, with exit status 2
        code = error.exit_code
        print(f"{PREFIX} error: {error}", file=sys.stderr)
    compare(case, want, code, args, messages, capsys.readouterr().err)


# --- real Megatron trees: every environment on the tree's worker (tree_driver) -------------------

TREE_PARAMS = [pytest.param(Path(t), id=runs.tree_id(t)) for t in runs.trees()] or [
    pytest.param(None, id="no-trees")
]


def _build(tree: str, work: Path) -> list[dict[str, Any]]:
    script = str(Path(tree) / "pretrain_gpt.py")
    cases = []
    for case in CASES:
        argv, _err = example_command(case["id"])
        if argv is None:
            continue
        cases.append({"name": case["id"], "mode": "launcher", "env": {**case["env"], **PLANNED},
                      "te_version": TE_PLANNED, "device_arch": DEVICE_ARCH_PLANNED, "argv": ["--dry-run", script, *argv]})
    return [{"tree": tree, "cases": cases}]


SUITE = tree_driver.SESSION.suite("parity", _build)


def tree_results(tree: Path) -> dict[str, dict[str, Any]]:
    return tree_driver.SESSION.results(SUITE, str(tree))


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_parity_on_real_megatron(tree, case):
    argv, err = example_command(case["id"])
    want = expected(case, _version(tree))
    if argv is None:
        assert want.get("error", {}).get("by") == "example", err
        return
    result = tree_results(tree)[case["id"]]
    assert result["error"] is None, result["error"]
    args, messages = None, []
    if result["code"] == 0:
        record = json.loads(result["stdout"])
        args = dict(record["effective_args"])
        args["perf_toggles_precision"] = record["precision"]
        messages = [m["text"] for m in record["messages"]]
    compare(case, want, result["code"], args, messages, result["stderr"])

