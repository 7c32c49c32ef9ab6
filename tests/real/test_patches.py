"""The in-tree patch sets (patches/<version>/) and ``megatron-perf-toggles patch``.

Fast: version detection, the patch files' own content, CLI errors. On real trees
(MEGATRON_LM_TREES): ``--check`` on every tree, apply/again/reverse round trips on copies (git
and the ``patch -p1`` fallback), and dry runs through a patched pretrain_gpt.py
(tests/launcher_cases.py, shared with test_launcher.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import launcher_cases as runs
import pytest

from megatron_perf_toggles.tools import patching

PROCESS_CHANGES = runs.REPO / "patches"
SET_NAMES = [name for _, name in patching.PATCH_SETS]
NO_FIELD = {"core_v0.13.0", "core_v0.14.0"}
TREE_PARAMS = [pytest.param(t, id=runs.tree_id(t)) for t in runs.trees()] or [
    pytest.param(None, id="no-trees")
]
TOUCHED = ("pretrain_gpt.py", "megatron/training/arguments.py")


def info(major: int, minor: int, patch: int, pre: str = "", quote: str = "'") -> str:
    return f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = {quote}{pre}{quote}\n"


# --- version detection ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    (info(0, 17, 0, "rc0"), ((0, 17, 0), "0.17.0rc0")),
    (info(0, 16, 0, quote='"'), ((0, 16, 0), "0.16.0")),
    (info(0, 20, 0), ((0, 20, 0), "0.20.0")),
])
def test_read_version(text: str, expected: tuple) -> None:
    assert patching.read_version(text) == expected


def test_read_version_without_numbers_is_an_error() -> None:
    with pytest.raises(patching.PatchError, match="MAJOR/MINOR/PATCH"):
        patching.read_version("__version__ = 'x'\n")


@pytest.mark.parametrize(("version", "parses", "expected"), [
    ((0, 13, 0), False, "core_v0.13.0"),
    ((0, 14, 0), False, "core_v0.14.0"),
    ((0, 15, 0), False, "core_v0.15.0"),
    ((0, 16, 0), False, "core_v0.16.0"),
    ((0, 17, 0), False, "core_v0.17.0"),  # the core_v0.17.0 tag says 0.17.0rc0
    ((0, 18, 0), True, "core_v0.18.0"),
    ((0, 18, 2), True, "core_v0.18.2"),
    ((0, 19, 1), True, "core_v0.19.0"),  # the core_v0.19.0 tag says 0.19.1
    ((0, 20, 0), True, "main"),
    ((0, 21, 3), True, "main"),
])
def test_patch_set_for(version: tuple[int, int, int], parses: bool, expected: str) -> None:
    tree = patching.Tree(Path("/x"), ".".join(map(str, version)), version, parses)
    assert patching.patch_set_for(tree) == expected


@pytest.mark.parametrize(("version", "parses", "needle"), [
    ((0, 12, 0), False, "older than the oldest supported"),
    ((0, 16, 0), True, "calls parse_and_validate_args"),
    ((0, 19, 1), False, "does not call parse_and_validate_args"),
])
def test_patch_set_for_refuses(version: tuple[int, int, int], parses: bool, needle: str) -> None:
    tree = patching.Tree(Path("/x"), ".".join(map(str, version)), version, parses)
    with pytest.raises(patching.PatchError, match=needle):
        patching.patch_set_for(tree)


# --- the patch files themselves -------------------------------------------------------------------


def _changed(patch: Path) -> tuple[list[str], list[str]]:
    lines = patch.read_text().splitlines()
    added = [x[1:] for x in lines if x.startswith("+") and not x.startswith("+++")]
    removed = [x[1:] for x in lines if x.startswith("-") and not x.startswith("---")]
    return added, removed


@pytest.mark.parametrize("name", SET_NAMES)
def test_patch_set_is_small_and_ours(name: str) -> None:
    files = {p.name for p in (PROCESS_CHANGES / name).glob("*.patch")}
    assert files == ({"pretrain_gpt.patch"} if name in NO_FIELD else {"pretrain_gpt.patch", "arguments.patch"})
    added, removed = _changed(PROCESS_CHANGES / name / "pretrain_gpt.patch")
    assert not removed and len(added) <= 16  # above the imports: checks and stand-ins; in __main__: the hooks
    assert any("megatron_perf_toggles.hooks import install_from_argv" in x for x in added)
    assert any("megatron_perf_toggles.hooks import prepare_from_argv" in x for x in added)
    if name in NO_FIELD:
        return
    added, removed = _changed(PROCESS_CHANGES / name / "arguments.patch")
    if name == "core_v0.15.0":
        assert not removed and "'--fused-single-qkv-rope', action='store_true'" in added[0]
    else:
        assert added == [] and [x.strip() for x in removed] == ['"fused_single_qkv_rope",']


# --- the command's errors -------------------------------------------------------------------------


def test_missing_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert patching.main(["--megatron", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[perf-toggles] error:") and "no such directory" in err[0]


def test_not_a_checkout_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert patching.main(["--megatron", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Megatron-LM checkout" in err[0]


def test_megatron_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert patching.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--megatron" in err[0]


# --- real trees -----------------------------------------------------------------------------------


def _expected_set(tree: str) -> str | None:
    name = Path(tree).name
    return name if name in SET_NAMES else None


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_detects_the_version(tree: str) -> None:
    found = patching.inspect_tree(tree)
    expected = _expected_set(tree)
    if expected is not None:
        assert patching.patch_set_for(found) == expected


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_check_applies_cleanly_and_changes_nothing(tree: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = {f: (Path(tree) / f).read_bytes() for f in TOUCHED}
    assert patching.main(["--megatron", tree, "--check"]) == 0
    assert "applies cleanly" in capsys.readouterr().out
    assert before == {f: (Path(tree) / f).read_bytes() for f in TOUCHED}


@pytest.mark.parametrize("tool", ["git", "patch"])
@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_apply_again_reverse_round_trip(tree: str, tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    if tool == "patch":
        if shutil.which("patch") is None:
            pytest.skip("patch(1) is not installed")
        real_which = shutil.which
        monkeypatch.setattr(patching.shutil, "which", lambda name: None if name == "git" else real_which(name))
    copy = tmp_path / "tree"
    for rel in [*TOUCHED, "megatron/core/package_info.py"]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(tree) / rel, copy / rel)
    original = {f: (copy / f).read_text() for f in TOUCHED}

    def run(*extra: str) -> str:
        assert patching.main(["--megatron", str(copy), *extra]) == 0
        return capsys.readouterr().out

    assert "applied" in run()
    patched = {f: (copy / f).read_text() for f in TOUCHED}
    assert "install_from_argv" in patched["pretrain_gpt.py"]
    expected_set = _expected_set(tree)
    if expected_set is not None:
        has_flag = "'--fused-single-qkv-rope'" in patched["megatron/training/arguments.py"]
        dropped = '"fused_single_qkv_rope",' not in patched["megatron/training/arguments.py"]
        assert has_flag == (expected_set == "core_v0.15.0")
        assert dropped
    assert "already applied" in run()
    assert "already applied" in run("--check")
    assert "would be taken out" in run("--check", "--reverse")
    assert "taken out" in run("--reverse")
    assert "not applied" in run("--reverse")
    assert original == {f: (copy / f).read_text() for f in TOUCHED}
    assert sorted(p.name for p in copy.rglob("*") if p.suffix in (".orig", ".rej")) == []


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_patched_pretrain_gpt_chains_named_providers(tree: str) -> None:
    payload = runs.payload(runs.results(tree)["patched-plugin"])
    by_name = {p["name"]: p["added"] for p in payload["providers"]}
    assert by_name["ptt_provider:add_my_flag"] == {"my_flag": 3}
    assert [p["name"] for p in payload["providers"]].count("megatron_perf_toggles:extra_args_provider") == 1
    fused = payload["decisions"]["fused_single_qkv_rope"]
    if runs.has_fused_field(tree):  # --fused-single-qkv-rope given, te assumed: honoured
        assert (fused["value"], fused["source"]) == (True, "cli")
    else:
        assert fused["value"] is False


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_patched_arguments_expose_fused_single_qkv_rope(tree: str) -> None:
    payload = runs.payload(runs.results(tree)["patched-own-only"])  # the plugin is not in this chain
    assert payload["decisions"] == {}
    if runs.has_fused_field(tree):
        assert payload["after_validate"]["fused_single_qkv_rope"] is True  # Megatron's own flag now
    else:
        assert "fused_single_qkv_rope" not in payload["after_validate"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_patched_pretrain_gpt_without_the_package_is_one_clear_line(tree: str) -> None:
    result = runs.results(tree)["patched-package-missing"]
    assert result["code"] == 2 and result["error"] is None
    assert "Traceback" not in result["stderr"]
    lines = [x for x in result["stderr"].splitlines() if "megatron-perf-toggles" in x]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: --extra-args-provider needs")


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_patched_dry_run_with_an_unknown_argument_is_one_line(tree: str) -> None:
    """Megatron's parser refuses it: argparse's own message, in the plugin's one line, exit 2
    (the dry run held the parser's output, and used to exit 2 saying nothing)."""
    result = runs.results(tree)["patched-unknown-arg"]
    assert result["code"] == 2, result
    said = [x for x in result["stderr"].splitlines() if x.startswith("[perf-toggles]")]
    assert said == ["[perf-toggles] error: Megatron's parser: unrecognized arguments: --no-such-flag 3 "
                    "(--no-such-flag is not a flag of this Megatron version; the script's --help lists "
                    "Megatron's flags)"], result["stderr"][-2000:]
    assert "usage:" not in result["stderr"]
