"""Primus without its Megatron submodule plans on the recorded surface of the Megatron-LM it pins.

How the pin is found (``frontends/primus/offline.pinned``): the checkout's gitlink of
``third_party/Megatron-LM`` (``git``), else the package's recorded table by the checkout's commit
(read from ``.git`` without ``git``) or by ``primus.__version__``; which surface serves
(``served``): the pin's, else the newest recorded release, saying why. The checkouts here are made
in a temporary folder; the commits are facts of Primus's and Megatron-LM's histories.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources

import pytest

from megatron_perf_toggles.core.facts import version_tuple
from megatron_perf_toggles.frontends.primus import offline as primus_offline
from megatron_perf_toggles.runtime import surface_replay as replay
from megatron_perf_toggles.tools import cli

PIN = "d3528a21301db2d12e92912b3ec025dc8a2ed4d6"  # Megatron-LM main of 2026-03-06: what Primus 26.4 and 26.5 pin
OLDER_PIN = "3bec9aa97dda898d16ff5a89bac0ed2b6682b172"  # what Primus v26.2 pinned: no surface recorded of it
PRIMUS_FD1EEAB = "fd1eeabbad15135e3702094087e96142b4b4eacb"  # Primus main of 2026-08-22 (pins PIN)


def _newest_release() -> str:
    releases = [n for n in replay.available() if n.startswith("core_v")]
    return sorted(releases, key=lambda n: version_tuple(n[len("core_v"):]))[-1]


def _pin_surface() -> str:
    names = [n for n in replay.available() if replay.load_surface(n).get("commit") == PIN]
    assert len(names) == 1, names
    return names[0]


def _checkout(root, version: str = "26.5"):
    (root / "primus").mkdir(parents=True)
    (root / "primus" / "__init__.py").write_text(f'from .core import x\n\n__version__ = "{version}"\n')
    return root


def _git(root, *argv: str) -> None:
    subprocess.run(["git", "-C", str(root), *argv], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(root)})


def test_the_pinned_surface_is_a_recorded_commit_with_a_release_for_its_undetectable_rules():
    surface = replay.load_surface(_pin_surface())
    assert surface["commit"] == PIN and surface["release"] in replay.available()
    assert surface["facts"]["version"].startswith("0.16.0")  # the tree's own package_info: main after 0.16


def test_every_recorded_pin_has_its_surface():
    table = json.loads((resources.files("megatron_perf_toggles") / "data" / "primus_pins.json").read_text())
    pins = set(table["commits"].values()) | set(table["versions"].values())
    assert PIN in pins and pins <= set(replay.commits()), pins - set(replay.commits())
    assert table["commits"][PRIMUS_FD1EEAB] == PIN


def test_a_git_checkout_is_read_by_its_gitlink(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed here: the gitlink cannot be read (the recorded table is tested below)")
    root = _checkout(tmp_path, version="0.0.0-unknown")  # the version alone would find no pin
    _git(root, "init", "-q")
    for sha, name in ((PIN, _pin_surface()), (OLDER_PIN, _newest_release())):
        _git(root, "update-index", "--add", "--cacheinfo", f"160000,{sha},third_party/Megatron-LM")
        _git(root, "commit", "-q", "-m", "pin")
        assert primus_offline.pinned(root)[0] == sha
        served, why = primus_offline.served(root)
        assert served == name and "gitlink" in why, why
    assert OLDER_PIN[:8] in why and "not recorded" in why and "newest recorded release" in why


def test_without_git_the_checkouts_commit_is_read_from_dot_git(tmp_path, monkeypatch):
    monkeypatch.setattr(primus_offline.shutil, "which", lambda name: None)
    root = _checkout(tmp_path, version="0.0.0-unknown")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".git" / "packed-refs").write_text(f"# pack-refs\n{PRIMUS_FD1EEAB} refs/heads/main\n")
    assert primus_offline.pinned(root)[0] == PIN
    served, why = primus_offline.served(root)
    assert served == _pin_surface() and PRIMUS_FD1EEAB[:8] in why


@pytest.mark.parametrize(("version", "pin"), [("26.5", PIN), ("26.4", PIN), ("0.2.0", None)])
def test_an_export_is_read_by_its_version(tmp_path, version, pin):
    root = _checkout(tmp_path, version=version)  # no .git: an exported tree
    assert primus_offline.pinned(root)[0] == pin
    served, why = primus_offline.served(root)
    if pin:
        assert served == _pin_surface() and f"Primus {version}" in why
    else:  # 0.2.0 was the version of two different pins: not in the table, and said so
        assert served == _newest_release() and "not in the package's recorded pins" in why, why


def test_a_flag_main_has_and_the_pin_lacks_is_refused_there_in_one_line(capsys):
    # Megatron-FSDP v2 (--megatron-fsdp-version) came after the pin: main's parser takes it and the
    # plugin answers its rule, the pin's parser refuses it as Megatron there would.
    flag = "--megatron-fsdp-version"
    flags = {n: {f for a in replay.load_surface(n)["actions"] for f in a["flags"]} for n in ("main", _pin_surface())}
    assert flag in flags["main"] and flag not in flags[_pin_surface()]
    argv = ["--json", "--", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", flag, "2"]
    assert cli.main(["explain", "--megatron-version", "main", *argv]) == 0
    fusion = json.loads(capsys.readouterr().out)["decisions"]["gradient_accumulation_fusion"]
    assert (fusion["value"], fusion["source"]) == (False, "guard") and flag in fusion["reason"]
    with pytest.raises(SystemExit) as done:
        cli.main(["explain", "--megatron-version", _pin_surface(), *argv])
    said = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(said) == 1 and f"unrecognized arguments: {flag}" in said[0], said
