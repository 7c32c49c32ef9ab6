"""The launcher (``python -m megatron_perf_toggles.run``) and the hooks under it.

Three layers: pure helpers (no Megatron); a small fake Megatron written to tmp, in both parse-path
shapes (<= 0.17: pretrain -> initialize_megatron -> parse_args; 0.18+: the script calls
parse_and_validate_args), which runs on any machine in well under a second per case; and real
Megatron-LM trees from MEGATRON_LM_TREES (tests/launcher_cases.py, on each tree's worker: tests/tree_driver.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import launcher_cases as runs
import pytest
import tree_driver
from example_layouts import all_layouts
from sandbox import clean_environ

from megatron_perf_toggles import chain_providers, extra_args_provider
from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.errors import PerfTogglesError
from megatron_perf_toggles.launcher import parse_hooks as hooks
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES
from megatron_perf_toggles.tools.patching import inspect_tree

REPO = runs.REPO
PLUGIN = "megatron_perf_toggles:extra_args_provider"  # the name users write, whichever module defines it
TREE_PARAMS = [pytest.param(t, id=runs.tree_id(t)) for t in runs.trees()] or [
    pytest.param(None, id="no-trees")
]


def launch(*argv: str, cwd: Path, pythonpath: list[Path] | None = None, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    full = clean_environ()
    full["PYTHONPATH"] = os.pathsep.join(str(p) for p in [REPO, *(pythonpath or [])])
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles.run", *argv], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120, check=False)


def assert_one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("[perf-toggles] error: ")
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


# --- pure helpers ---------------------------------------------------------------------------------


def test_pull_provider_specs_keeps_the_other_words_in_order() -> None:
    specs, rest = hooks.pull_provider_specs(
        ["--num-layers", "2", "--extra-args-provider", "a:b", "--lr=1e-4", "--extra-args-provider=c:d", "-h"])
    assert specs == ["a:b", "c:d"]
    assert rest == ["--num-layers", "2", "--lr=1e-4", "-h"]


def test_pull_provider_specs_missing_value_is_one_error() -> None:
    with pytest.raises(PerfTogglesError, match="extra-args-provider"):
        hooks.pull_provider_specs(["--extra-args-provider"])


def test_resolve_provider_module_alone_means_extra_args_provider() -> None:
    assert hooks.resolve_provider("megatron_perf_toggles") is extra_args_provider
    assert hooks.resolve_provider("megatron_perf_toggles.runtime.provider:extra_args_provider") is extra_args_provider
    assert hooks.provider_name(extra_args_provider) == "megatron_perf_toggles:extra_args_provider"


@pytest.mark.parametrize(("spec", "needle"), [
    ("no_such_module_ptt:f", "cannot import module 'no_such_module_ptt'"),
    ("megatron_perf_toggles:no_such_function", "has no function 'no_such_function'"),
    ("megatron_perf_toggles:__version__", "not a function"),
    (":f", "expected MODULE:FUNCTION"),
])
def test_resolve_provider_errors_name_the_culprit(spec: str, needle: str) -> None:
    with pytest.raises(hooks.ProviderSpecError, match="extra-args-provider") as caught:
        hooks.resolve_provider(spec)
    assert needle in str(caught.value)
    assert caught.value.spec == spec


def test_a_provider_spec_is_checked_without_importing_anything() -> None:
    """A malformed spec, or a module whose package is nowhere on the path, is refused before any
    import (the launcher does this before torch); a findable one is left to the import."""
    before = set(sys.modules)
    for spec, needle in (("no_such_module_ptt.sub:f", "no module named 'no_such_module_ptt'"),
                         ("bad spec", "expected MODULE:FUNCTION")):
        with pytest.raises(hooks.ProviderSpecError, match="extra-args-provider") as caught:
            hooks.check_provider_spec(spec)
        assert needle in str(caught.value)
    assert hooks.check_provider_spec("xmlrpc.server") == ("xmlrpc.server", "extra_args_provider")
    assert set(sys.modules) - before == set()


def test_a_finder_that_fails_leaves_the_provider_to_its_import(monkeypatch) -> None:
    import importlib.util

    def broken(name, package=None):
        raise RuntimeError("a broken finder")

    monkeypatch.setattr(importlib.util, "find_spec", broken)
    assert hooks.check_provider_spec("no_such_module_ptt:f") == ("no_such_module_ptt", "f")


# Runs an entry point as users run it, then notes which of torch and Megatron were imported.
IMPORT_PROBE = """import json, runpy, sys
out, how = sys.argv.pop(1), sys.argv.pop(1)
code = 0
try:
    if how == "launcher":
        sys.argv[0] = "megatron_perf_toggles.run"
        runpy.run_module("megatron_perf_toggles.run", run_name="__main__", alter_sys=True)
    else:  # the top of a patched script
        from megatron_perf_toggles.launcher.parse_hooks import prepare_from_argv
        prepare_from_argv(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
open(out, "w").write(json.dumps({"imported": [m for m in ("megatron", "torch") if m in sys.modules], "exit": code}))
sys.exit(code)
"""


@pytest.mark.parametrize("spec", ["no_such_module_ptt:f", "no_such_module_ptt.sub:add", "bad spec"])
@pytest.mark.parametrize("how", ["launcher", "patched"])
def test_a_misspelt_provider_is_refused_before_torch(script_dir: Path, spec: str, how: str) -> None:
    """One line within a second: importing torch alone takes seconds (where torch is not
    installed, the launcher route cannot show the order, only the one line)."""
    out = script_dir / "probe.json"
    env = {**tree_driver.driver_env(path=[script_dir]), "MEGATRON_PERF_TOGGLES_DRY_RUN": "1"}
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE, str(out), how, "--dry-run", "train.py",
                           "--extra-args-provider", spec], cwd=script_dir, capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert out.exists(), done.stderr
    assert json.loads(out.read_text()) == {"imported": [], "exit": 2}, done.stderr
    assert_one_line_error(done, "--extra-args-provider", spec)
    assert not (script_dir / "ran").exists()


def test_flatten_skips_none_expands_chains_and_dedupes() -> None:
    def own(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return parser

    chained = chain_providers(own, extra_args_provider)
    assert hooks.flatten([None, chained, own, extra_args_provider]) == [own, extra_args_provider]


def test_dry_run_env_is_validated() -> None:
    assert hooks.dry_run_requested({"MEGATRON_PERF_TOGGLES_DRY_RUN": "yes"}) is True
    assert hooks.dry_run_requested({}) is False
    with pytest.raises(PerfTogglesError, match="MEGATRON_PERF_TOGGLES_DRY_RUN"):
        hooks.dry_run_requested({"MEGATRON_PERF_TOGGLES_DRY_RUN": "maybe"})


# --- command-line errors: one line, exit 2, nothing started ----------------------------------------


@pytest.fixture
def script_dir(tmp_path: Path) -> Path:
    """A script that leaves a marker if it ever runs, and a provider module beside it."""
    (tmp_path / "train.py").write_text("from pathlib import Path\nPath(__file__).with_name('ran').touch()\n")
    (tmp_path / "tmp_provider.py").write_text("def add(parser):\n    return parser\n")
    (tmp_path / "broken_provider.py").write_text("raise RuntimeError('boom at import')\n")
    return tmp_path


def test_help_explains(tmp_path: Path) -> None:
    done = launch("--help", cwd=tmp_path)
    assert done.returncode == 0
    for needle in ("--extra-args-provider", "--dry-run", "MEGATRON_PERF_TOGGLES_DRY_RUN", "PYTHONPATH", "SCRIPT"):
        assert needle in done.stdout


@pytest.mark.parametrize(("argv", "needles"), [
    (["--extra-args-provider", "no_such_module_ptt:f", "train.py"], ("no_such_module_ptt",)),
    (["--extra-args-provider", "tmp_provider:nope", "train.py"], ("tmp_provider", "nope")),
    (["train.py", "--extra-args-provider=tmp_provider:nope"], ("tmp_provider", "nope")),
    (["--extra-args-provider", "broken_provider:add", "train.py"], ("broken_provider", "boom at import")),
    (["--dry-run", "missing_script.py"], ("script not found", "missing_script.py")),
    ([], ("SCRIPT",)),
    (["train.py", "--extra-args-provider"], ("--extra-args-provider",)),
    (["--fail-if-no-fit", "train.py"], ("--fail-if-no-fit plans a dry run", "--dry-run")),
])
def test_bad_input_is_one_line_and_starts_nothing(script_dir: Path, argv: list[str], needles: tuple[str, ...]) -> None:
    done = launch(*argv, cwd=script_dir, pythonpath=[script_dir])
    assert_one_line_error(done, *needles)
    assert not (script_dir / "ran").exists()


def test_bad_dry_run_env_is_one_line(script_dir: Path) -> None:
    done = launch("train.py", cwd=script_dir, env={"MEGATRON_PERF_TOGGLES_DRY_RUN": "perhaps"})
    assert_one_line_error(done, "MEGATRON_PERF_TOGGLES_DRY_RUN")
    assert not (script_dir / "ran").exists()


def test_megatron_not_importable_says_pythonpath(script_dir: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import megatron.training"], cwd=script_dir,
                           capture_output=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    if probe.returncode == 0:
        pytest.skip("megatron.training is importable in this environment: cannot test its absence")
    done = launch("--dry-run", "train.py", cwd=script_dir)
    assert_one_line_error(done, "Megatron-LM", "PYTHONPATH=/path/to/Megatron-LM")
    assert not (script_dir / "ran").exists()


# --- a fake Megatron in both parse-path shapes (runs anywhere, fast) -------------------------------

FAKE_ARGUMENTS = '''\
import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    training = parser.add_argument_group(title="training")
    training.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                          dest="gradient_accumulation_fusion")
    training.add_argument("--cross-entropy-loss-fusion", action="store_true")
    training.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    training.add_argument("--tokenizer-type", default=None)
    training.add_argument("--tensorboard-dir", default=None)
    training.add_argument("--yaml-cfg", default=None)
    training.add_argument("--use-checkpoint-args", action="store_true")
    mixed = parser.add_argument_group(title="mixed precision")
    mixed.add_argument("--bf16", action="store_true")
    mixed.add_argument("--grad-reduce-in-bf16", action="store_true")
    parser.add_argument_group(title="distributed").add_argument("--ddp-average-in-collective", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args()[0]
    return parser.parse_args()


def validate_args(args, defaults={}):
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    print("fake validate_args chatter")
    return args
'''

FAKE_NEW_EXTRA = '''

def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    global ARGS
    ARGS = args
    return args
'''

FAKE_OLD_INITIALIZE = '''\
import os

from megatron.training.arguments import parse_args, validate_args

ARGS = None


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        allow_no_cuda=False, parsed_args=None):
    if not allow_no_cuda and not os.environ.get("FAKE_CUDA"):
        raise AssertionError("Megatron requires CUDA.")
    global ARGS
    ARGS = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(ARGS, args_defaults)
'''

FAKE_OLD_TRAINING = '''\
import json

from megatron.training import arguments
from megatron.training.initialize import initialize_megatron


def pretrain(a, b, c, d, extra_args_provider=None, args_defaults={}):
    arguments.parse_args(ignore_unknown_args=True)  # a peek, like in-process restart's
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    from megatron.training import initialize
    print("TRAINING", json.dumps(initialize.ARGS.perf_toggles, sort_keys=True))
'''

FAKE_NEW_INITIALIZE = '''\
def initialize_megatron(allow_no_cuda=False, skip_mpu_initialization=False):
    raise AssertionError("Megatron requires CUDA.")
'''

FAKE_NEW_TRAINING = '''\
import json


def pretrain(args, b=None):
    print("TRAINING", json.dumps(args.perf_toggles, sort_keys=True))
'''

OWN_PROVIDER = '''\
def own(parser):
    parser.add_argument_group(title="own").add_argument("--own-flag", action="store_true")
    parser.add_argument("--own-default", default=None)
    return parser
'''

FAKE_OLD_SCRIPT = OWN_PROVIDER + '''
from megatron.training.training import pretrain

pretrain(None, None, None, None, args_defaults={"own_default": "from-defaults"}, extra_args_provider=own)
'''

FAKE_NEW_SCRIPT = OWN_PROVIDER + '''
from megatron.training.arguments import parse_and_validate_args
from megatron.training.training import pretrain

args = parse_and_validate_args(extra_args_provider=own, args_defaults={"own_default": "from-defaults"})
pretrain(args)
'''


def write_fake(root: Path, shape: str) -> Path:
    files = {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/package_info.py": "__version__ = '0.99.0'\n",
        "megatron/training/__init__.py": "",
        "megatron/training/arguments.py": FAKE_ARGUMENTS + (FAKE_NEW_EXTRA if shape == "new" else ""),
        "megatron/training/initialize.py": FAKE_OLD_INITIALIZE if shape == "old" else FAKE_NEW_INITIALIZE,
        "megatron/training/training.py": FAKE_OLD_TRAINING if shape == "old" else FAKE_NEW_TRAINING,
        "train.py": FAKE_OLD_SCRIPT if shape == "old" else FAKE_NEW_SCRIPT,
        "user_provider.py": "def mine(parser):\n    parser.add_argument('--mine', type=int)\n    return parser\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(params=["old", "new"])
def fake(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return write_fake(tmp_path / request.param, request.param)


def test_fake_dry_run_summary_fits_a_screen_and_keeps_the_record_in_a_file(fake: Path) -> None:
    done = launch("--dry-run", "train.py", "--bf16", "--tensorboard-dir", "tb", cwd=fake, pythonpath=[fake])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 60 and "fake validate_args chatter" not in done.stdout + done.stderr
    table = [line for line in lines if line.strip().startswith("grad_reduce_in_bf16 ")]
    assert len(table) == 1 and " on " in table[0]  # the decision table, once
    record = next(line.split(": ", 1)[1] for line in lines if line.startswith("full record (JSON): "))
    log = next(line.split(": ", 1)[1] for line in lines if line.startswith("Megatron's output"))
    assert json.loads(Path(record).read_text())["log_dirs"] == {"tensorboard_dir": "tb/bf16"}
    assert "fake validate_args chatter" in Path(log).read_text()  # Megatron's output went to the file


def test_fake_dry_run_prints_json_alone_and_keeps_the_scripts_provider(fake: Path) -> None:
    done = launch("--dry-run", "--json", "--extra-args-provider", "user_provider:mine", "train.py", "--bf16", "--own-flag",
                  "--mine", "5", "--extra-args-provider=megatron_perf_toggles", "--tensorboard-dir", "tb",
                  cwd=fake, pythonpath=[fake])
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)  # stdout is the JSON and nothing else
    assert "fake validate_args chatter" in done.stderr
    assert "[perf-toggles] grad_reduce_in_bf16: on" in done.stderr  # the table, for people
    assert payload["log_dirs"] == {"tensorboard_dir": "tb/bf16"}
    assert not (fake / "tb").exists()  # a dry run writes nothing
    names = [p["name"] for p in payload["providers"]]
    assert names == ["__main__:own", "user_provider:mine", PLUGIN]  # script's own first, plugin once, last
    assert payload["providers"][0]["added"] == {"own_flag": True, "own_default": "from-defaults"}
    assert payload["providers"][1]["added"] == {"mine": 5}
    assert payload["args_defaults"] == {"own_default": "from-defaults"}
    assert payload["megatron"]["parse_path"] == ("initialize_megatron" if fake.name == "old"
                                                 else "parse_and_validate_args")
    assert payload["megatron"]["version"] == "0.99.0"
    assert payload["precision"] == "bf16"
    assert set(payload["decisions"]) >= {t.dest for t in TOGGLES}
    assert payload["dry_run"] is True


def test_fake_real_run_decides_once_and_reaches_training(fake: Path) -> None:
    done = launch("train.py", "--bf16", "--tensorboard-dir", "tb", cwd=fake, pythonpath=[fake],
                  env={"FAKE_CUDA": "1", "GRAD_REDUCE_IN_BF16": "0"})
    assert done.returncode == 0, done.stderr
    assert (fake / "tb" / "bf16" / "perf_toggles.json").is_file()
    training = [line for line in done.stdout.splitlines() if line.startswith("TRAINING ")]
    assert len(training) == 1
    decided = json.loads(training[0][len("TRAINING "):])
    assert decided["grad_reduce_in_bf16"] == {"value": False, "source": "env", "reason": "GRAD_REDUCE_IN_BF16=0",
                                              "peak_memory_delta_mb": None}  # no model shape: memory unknown
    table = [line for line in done.stdout.splitlines() if line.startswith("[perf-toggles] grad_reduce_in_bf16:")]
    assert len(table) == 1  # announced once, not again for the peek or a second parse


def test_fake_dry_run_via_env_and_quiet_on_other_ranks(fake: Path) -> None:
    done = launch("train.py", cwd=fake, pythonpath=[fake], env={"MEGATRON_PERF_TOGGLES_DRY_RUN": "1", "RANK": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


def test_fake_old_shape_never_reaches_the_cuda_assert_in_a_dry_run(tmp_path: Path) -> None:
    fake = write_fake(tmp_path, "old")
    done = launch("--dry-run", "train.py", cwd=fake, pythonpath=[fake])
    assert done.returncode == 0, done.stderr
    assert "requires CUDA" not in done.stderr


def test_install_rebinds_stale_references_and_uninstall_restores(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake = write_fake(tmp_path, "old")
    monkeypatch.syspath_prepend(str(fake))
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with PROCESS_CHANGES.scope():  # the hooks' changes are undone at its end, newest first
            installed = hooks.hook_parse_path([extra_args_provider])
            from megatron.training import arguments, initialize, training

            original = installed.originals["parse_args"]
            assert arguments.parse_args is initialize.parse_args is installed.wrappers["parse_args"]
            assert training.initialize_megatron is initialize.initialize_megatron is installed.wrappers[
                "initialize_megatron"]
            assert hooks.hook_parse_path([]) is installed  # a second install updates, never wraps twice
            assert getattr(arguments.parse_args, hooks.ORIGINAL_ATTR) is original
    finally:
        for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
            del sys.modules[name]
    assert initialize.parse_args is original
    assert hooks.active() is None


# --- real Megatron-LM trees -----------------------------------------------------------------------


def _names(payload: dict) -> list[str]:
    return [p["name"] for p in payload["providers"]]


def _expected_path(tree: str) -> str:
    return "parse_and_validate_args" if inspect_tree(tree).script_parses_itself else "initialize_megatron"


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_pretrain_gpt_dry_run(tree: str) -> None:
    payload = runs.payload(runs.results(tree)["plain"])
    assert payload["megatron"]["version"] == inspect_tree(tree).version
    assert payload["megatron"]["path"] == str(Path(tree).resolve())
    assert payload["megatron"]["parse_path"] == _expected_path(tree)
    assert payload["precision"] == "bf16"
    assert set(payload["decisions"]) >= {t.dest for t in TOGGLES}
    assert _names(payload).count(PLUGIN) == 1 and _names(payload)[-1] == PLUGIN
    assert set(payload["after_validate"]) >= {t.dest for t in TOGGLES if t.dest != "fused_single_qkv_rope"}


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_dry_run_decides_as_a_real_launch(tree: str) -> None:
    """The launcher without --dry-run (Megatron's own parse and validate, then the namespace the run
    would train with) against the dry run of the same command line: same guards, same derived settings."""
    dry = runs.payload(runs.results(tree)["real-launch-dry"])
    real = runs.results(tree)["real-launch"]
    assert real["error"] is None and real["code"] == 0, (real["error"], real["stderr"][-2000:])
    line = next(ln for ln in real["stdout"].splitlines() if ln.startswith("REAL-LAUNCH "))
    launched = json.loads(line.split(" ", 1)[1])
    assert launched["decisions"] == dry["decisions"]
    assert launched["precision"] == dry["precision"]
    for key, value in launched["derived"].items():
        assert str(dry["effective_args"].get(key)) == str(value), key


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_pretrain_gpt_dry_run_with_extra_providers(tree: str) -> None:
    payload = runs.payload(runs.results(tree)["provider"])  # dry run from the environment variable
    names = _names(payload)
    assert names[-3:] == ["ptt_provider:add_my_flag", "ptt_provider:add_other", PLUGIN]
    by_name = {p["name"]: p["added"] for p in payload["providers"]}
    assert by_name["ptt_provider:add_my_flag"] == {"my_flag": 7}
    assert by_name["ptt_provider:add_other"] == {"other_flag": True}
    assert payload["decisions"]["grad_reduce_in_bf16"]["source"] == "env"
    assert payload["after_validate"]["grad_reduce_in_bf16"] is False


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_unknown_flag_without_its_provider_is_rejected(tree: str) -> None:
    result = runs.results(tree)["unknown-flag"]
    assert result["code"] == 2 and "--my-flag" in result["stderr"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_refused_request_is_one_line(tree: str) -> None:
    result = runs.results(tree)["cannot-honour"]
    assert result["code"] == 2 and result["error"] is None
    assert "Traceback" not in result["stderr"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("[perf-toggles] error:")]
    assert len(errors) == 1 and "--cross-entropy-fusion-impl te" in errors[0]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_dry_run_with_the_plugin_off_leaves_the_log_directory_as_given(tree: str) -> None:
    payload = runs.payload(runs.results(tree)["stock-off-log-dir"])
    given = payload["command"][payload["command"].index("--tensorboard-dir") + 1]
    assert payload["log_dirs"] == {} and payload["effective_args"]["tensorboard_dir"] == given


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_dry_run_summary_says_why_it_exits_3(tree: str) -> None:
    """In the default summary output this process's stderr is held for Megatron's output file: the
    --fail-if-no-fit line must still reach the real stderr."""
    result = runs.results(tree)["no-fit-summary"]
    assert result["code"] == 3, result["stderr"][-3000:]
    said = [line for line in result["stderr"].splitlines() if line.startswith("[perf-toggles] error:")]
    assert len(said) == 1 and "does not fit" in said[0], result["stderr"][-3000:]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
@pytest.mark.parametrize("case", ["no-fit", "patched-no-fit"])
def test_real_dry_run_exits_3_after_a_plan_that_does_not_fit_when_asked(tree: str, case: str) -> None:
    """--fail-if-no-fit (the launcher) or MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT=1 (a patched
    checkout): the whole record first, then one line and errors.DoesNotFitError's status."""
    result = runs.results(tree)[case]
    assert result["error"] is None and result["code"] == 3, result["stderr"][-3000:]
    record = json.loads(result["stdout"])
    assert record["memory"]["verdict"]["plan"] == "does_not_fit" and record["target"]["world_size"] == 8
    errors = [line for line in result["stderr"].splitlines() if line.startswith("[perf-toggles] error:")]
    assert len(errors) == 1 and errors[0].startswith("[perf-toggles] error: the plan does not fit: planned peak")


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
@pytest.mark.parametrize("style", ["upstream", "rocm"])
def test_real_chaining_with_the_scripts_own_provider(tree: str, style: str) -> None:
    payload = runs.payload(runs.results(tree)[f"mimic-{style}"])
    assert payload["megatron"]["parse_path"] == _expected_path(tree)
    first = payload["providers"][0]
    if style == "upstream":
        assert first["name"] == "ptt_provider:modelopt_standin"
        assert first["added"] == {"standin_flag": True, "standin_default": "from-args-defaults"}
    else:  # the fork's combined provider names the plugin itself: still one set of flags, one decision
        assert first["name"] == "ptt_provider:combined_args_provider"
        assert first["added"]["rocm_standin_flag"] is True and first["added"]["standin_flag"] is True
    assert _names(payload).count(PLUGIN) == 1
    assert payload["args_defaults"] == {"tokenizer_type": "NullTokenizer", "standin_default": "from-args-defaults"}
    assert set(payload["decisions"]) >= {t.dest for t in TOGGLES}


# --- NVIDIA's example layouts, planned from a machine without their GPUs ---------------------------


LAYOUTS = {layout.name: layout for layout in all_layouts("/unused")}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_real_example_layout_dry_run_with_world_size(tree: str, name: str) -> None:
    layout = LAYOUTS[name]
    result = runs.results(tree)[f"layout:{name}"]
    payload = runs.payload(result)
    args = payload["effective_args"]
    # Megatron itself worked these out from the planned world: TP x PP x DP = world size.
    assert args["world_size"] == layout.world_size
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (layout.tp, layout.pp)
    assert args["data_parallel_size"] == layout.world_size // (layout.tp * layout.pp)
    assert payload["target"]["world_size"] == layout.world_size
    assert payload["target"]["gpu"]["vendor"] in ("cuda", "rocm")  # planned: this machine has none or one
    assert result["stand_ins_undone"], "a stand-in outlived the dry run"


# --- one answer: explain, the dry run and a real launch decide alike ------------------------------


def _subprocess(argv: list[str], tmp: Path, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess:
    env = clean_environ(tree_driver.SESSION.environ)
    env.update(PYTHONPATH=str(REPO), CUDA_DEVICE_MAX_CONNECTIONS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    env.update(extra)
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=tmp, env=env,
                          timeout=timeout)


def _decided(record: dict) -> dict:
    return {"decisions": record["decisions"], "precision": record["precision"], "log_dirs": record["log_dirs"],
            "wgrad_path": record["wgrad_path"]}


def _spread(trees: list[str]) -> list[str]:
    """The oldest, a middle and the newest tree: both parse paths, at three points in time."""
    picked = [trees[0], trees[len(trees) // 2], trees[-1]] if trees else []
    return list(dict.fromkeys(picked))


EXPLAIN_MATRIX = [pytest.param(t, name, gpu, id=f"{runs.tree_id(t)}-{name}-{gpu}")
                  for t in _spread(runs.trees()) for name, gpu in (
                      ("gpt3-175b-tp8-pp16", "h100"), ("llama3-8b-fp8", "h200"), ("llama3-70b-tp8-pp4", "mi355x"))] or [
    pytest.param(None, None, None, id="no-trees")]


@pytest.mark.real_megatron
@pytest.mark.parametrize(("tree", "name", "gpu"), EXPLAIN_MATRIX)
def test_explain_decides_as_the_launcher_dry_run_on_the_same_tree(tmp_path: Path, tree: str, name: str,
                                                                 gpu: str) -> None:
    """Both as their command lines' ``main``, on the tree's worker (tests/tree_driver.py): explain
    first, and each leaves the process as it found it, so neither decides from what the other left."""
    layout = LAYOUTS[name]
    argv = [a.replace("/unused", str(tmp_path)) for a in layout.argv]
    plan = ["--world-size", str(layout.world_size), "--gpu", gpu]
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    found = runs.run_cases(tree, [
        {"name": "explain", "mode": "cli", "env": env,
         "argv": ["explain", "--megatron", tree, "--json", *plan, "--", *argv]},
        {"name": "dry", "mode": "launcher", "env": env,
         "argv": ["--dry-run", "--json", *plan, f"{tree}/pretrain_gpt.py", *argv]}])
    for case in found.values():
        assert case["error"] is None and case["code"] == 0, case["error"] or case["stderr"][-3000:]
        assert case["stand_ins_undone"], f"{case['name']} left its planned machine behind"
    assert _decided(json.loads(found["explain"]["stdout"])) == _decided(json.loads(found["dry"]["stdout"]))


def _pair_as_processes(tree: str, name: str, gpu: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    work = tree_driver.SESSION.tempdir("ptt-explain-")
    layout = LAYOUTS[name]
    argv = [a.replace("/unused", str(work)) for a in layout.argv]
    plan = ["--world-size", str(layout.world_size), "--gpu", gpu]
    return (_subprocess(["megatron_perf_toggles.run", "--dry-run", "--json", *plan, f"{tree}/pretrain_gpt.py", *argv], work),
            _subprocess(["megatron_perf_toggles", "explain", "--megatron", tree, "--json", *plan, "--", *argv], work))


PAIR = [param.values for param in EXPLAIN_MATRIX[-1:] if param.values[0] is not None]
PROCESS_PAIR = tree_driver.SESSION.background("explain-and-dry-run-processes",
                                              lambda: _pair_as_processes(*PAIR[0])) if PAIR else ""


@pytest.mark.real_megatron
@pytest.mark.parametrize(("tree", "name", "gpu"), EXPLAIN_MATRIX[-1:])
def test_explain_and_the_dry_run_decide_alike_as_processes_of_their_own(tree: str, name: str, gpu: str) -> None:
    """The newest tree's case as users run both: processes of their own (a background job)."""
    dry, explain = tree_driver.SESSION.outcome(PROCESS_PAIR)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert explain.returncode == 0, explain.stderr[-3000:]
    assert _decided(json.loads(explain.stdout)) == _decided(json.loads(dry.stdout))


COMPILE_PROBE = """import torch

from megatron_perf_toggles.launcher import import_shims

print("COMPILE", "as-is" if torch.compile is import_shims._as_is else "real", flush=True)
"""


def test_only_a_dry_run_leaves_compile_decorators_uncompiled_and_it_must_reach_a_plan(tmp_path: Path) -> None:
    """A real launch compiles what Megatron compiles. A dry run leaves torch.compile as is (it
    ends in its report, before anything compiled runs); a script that never reaches Megatron's
    parse would run on without a plan, so that is one error line, exit 2."""
    pytest.importorskip("torch")
    tree = write_fake(tmp_path / "new", "new")  # a Megatron to import; the probe never parses
    (tree / "probe.py").write_text(COMPILE_PROBE)
    real = launch("probe.py", cwd=tree, pythonpath=[tree])
    assert real.returncode == 0 and "COMPILE real" in real.stdout, real.stderr
    dry = launch("--dry-run", "--json", "probe.py", cwd=tree, pythonpath=[tree])
    assert "COMPILE as-is" in dry.stderr and dry.stdout == ""
    line = [line for line in dry.stderr.splitlines() if line.startswith("[perf-toggles]")]
    assert dry.returncode == 2 and len(line) == 1 and "ended before Megatron parsed its arguments" in line[0]
