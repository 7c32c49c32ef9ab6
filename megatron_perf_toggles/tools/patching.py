"""``megatron-perf-toggles patch --megatron PATH [--check|--reverse]``: the small in-tree patch set.

For people who run their own Megatron-LM checkout and would rather edit it than use the launcher.
Per supported version, two tiny patches: pretrain_gpt.py learns ``--extra-args-provider MOD:FUNC``
(repeatable, chained with its own provider through ``hooks.install_from_argv``), and arguments.py
exposes ``--fused-single-qkv-rope`` (0.15: a declared flag; 0.16+: dropped from the exclude list
so the generated flag exists; 0.13/0.14 have no such field).

The version is read from ``megatron/core/package_info.py`` as text (nothing is imported) and
checked against a fingerprint of the parse path; ``git apply`` (or ``patch -p1``) does the rest,
all files or none.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.env import read_text_setting
from ..errors import PREFIX, OneLineArgumentParser, PerfTogglesError, report

PROG = "megatron-perf-toggles patch"
PATCHES_ENV = "MEGATRON_PERF_TOGGLES_PATCHES"  # registered in core.registry.SETTINGS

# (first version it covers, patch set); a tree gets the last set whose version is <= its own.
# Tags report other numbers than their names: core_v0.17.0 says 0.17.0rc0, core_v0.19.0 says
# 0.19.1, main says 0.20.0.
PATCH_SETS: tuple[tuple[tuple[int, int, int], str], ...] = (
    ((0, 13, 0), "core_v0.13.0"),
    ((0, 14, 0), "core_v0.14.0"),
    ((0, 15, 0), "core_v0.15.0"),
    ((0, 16, 0), "core_v0.16.0"),
    ((0, 17, 0), "core_v0.17.0"),
    ((0, 18, 0), "core_v0.18.0"),
    ((0, 18, 2), "core_v0.18.2"),
    ((0, 19, 0), "core_v0.19.0"),
    ((0, 20, 0), "main"),
)
# From 0.18 the script parses itself (parse_and_validate_args); up to 0.17 pretrain() does.
SELF_PARSING_FROM = (0, 18, 0)


class PatchError(PerfTogglesError):
    """The tree cannot be identified or the patch set does not apply."""


@dataclass(frozen=True, slots=True)
class Tree:
    """A Megatron-LM checkout as far as patching needs to know it."""

    root: Path
    version: str
    version_tuple: tuple[int, int, int]
    script_parses_itself: bool  # pretrain_gpt.py calls parse_and_validate_args (0.18+)

    @property
    def family(self) -> str:
        return "parse_and_validate_args" if self.script_parses_itself else "pretrain(extra_args_provider=...)"


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s*=\s*(?:'([^']*)'|\"([^\"]*)\"|(\d+))", text, re.MULTILINE)
    if match is None:
        return None
    return next(g for g in match.groups() if g is not None)


def read_version(text: str) -> tuple[tuple[int, int, int], str]:
    """((major, minor, patch), '0.17.0rc0') from package_info.py source, or PatchError."""
    parts = [_field(text, name) for name in ("MAJOR", "MINOR", "PATCH")]
    if any(p is None or not p.isdigit() for p in parts):
        raise PatchError("megatron/core/package_info.py has no MAJOR/MINOR/PATCH numbers")
    numbers = (int(parts[0]), int(parts[1]), int(parts[2]))  # type: ignore[arg-type]
    return numbers, ".".join(map(str, numbers)) + (_field(text, "PRE_RELEASE") or "")


def inspect_tree(root: str | os.PathLike[str]) -> Tree:
    """Identify a checkout from its files (never imports it)."""
    path = Path(root)
    info, script = path / "megatron" / "core" / "package_info.py", path / "pretrain_gpt.py"
    if not path.is_dir():
        raise PatchError(f"--megatron {root}: no such directory")
    for needed in (info, script):
        if not needed.is_file():
            raise PatchError(f"--megatron {root}: not a Megatron-LM checkout (no {needed.relative_to(path)})",
                             "give the directory that holds pretrain_gpt.py and megatron/")
    numbers, version = read_version(info.read_text(encoding="utf-8"))
    parses = "parse_and_validate_args(" in script.read_text(encoding="utf-8")
    return Tree(path.resolve(), version, numbers, parses)


def patch_set_for(tree: Tree) -> str:
    """The patch set by version, checked against the parse-path fingerprint."""
    eligible = [name for first, name in PATCH_SETS if first <= tree.version_tuple]
    if not eligible:
        raise PatchError(f"Megatron-LM {tree.version} at {tree.root} is older than the oldest supported "
                         f"version ({PATCH_SETS[0][1]})", "use the launcher: python -m megatron_perf_toggles.run")
    name = eligible[-1]
    expected = tree.version_tuple >= SELF_PARSING_FROM
    if tree.script_parses_itself != expected:
        raise PatchError(
            f"Megatron-LM {tree.version} at {tree.root}: pretrain_gpt.py "
            f"{'calls' if tree.script_parses_itself else 'does not call'} parse_and_validate_args, unlike "
            f"upstream {name} (a fork or a modified checkout?)",
            "pick a set with --patch-set NAME, or use the launcher: python -m megatron_perf_toggles.run")
    return name


def patches_dir() -> Path:
    """Where the patch sets live: $MEGATRON_PERF_TOGGLES_PATCHES, the package data, or the repository."""
    package = Path(__file__).resolve().parent.parent  # megatron_perf_toggles/
    configured = read_text_setting(PATCHES_ENV, os.environ)
    candidates = [Path(configured)] if configured else []
    candidates += [package / "data" / "patches", package.parent / "patches"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise PatchError("the patch sets are not installed with this copy of megatron-perf-toggles",
                     f"set {PATCHES_ENV} to the patches/ directory of its source")


def available_sets(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and any(p.glob("*.patch")))


def patch_files(directory: Path, name: str) -> list[Path]:
    files = sorted((directory / name).glob("*.patch"))
    if not files:
        raise PatchError(f"no patch set {name!r} in {directory}", f"known: {', '.join(available_sets(directory))}")
    return files


@dataclass(frozen=True, slots=True)
class PatchResult:
    """What applying (or checking) a patch series gave: whether it applied, and why not."""

    ok: bool
    detail: str  # the tool's first meaningful line when it refused


def _first_line(text: str) -> str:
    """The most telling line of git's or patch's complaint: which file does not apply."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("patch does not apply", "patch failed", "FAILED", "error:"):
        hits = [line for line in lines if marker in line]
        if hits:
            return hits[0]
    return lines[0] if lines else ""


def _git_apply(root: Path, files: list[Path], check: bool, reverse: bool) -> PatchResult:
    env = dict(os.environ)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(var, None)
    # Inside an enclosing repository git apply would resolve paths from that repository's top and
    # silently skip ours: stop the repository search at the tree (its own .git still counts).
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    cmd = ["git", "apply", "--verbose", *(["--check"] if check else []), *(["--reverse"] if reverse else []),
           *map(str, files)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    if done.returncode == 0 and "Skipped patch" in text:
        return PatchResult(False, "git apply skipped a file (is the tree inside another git repository?)")
    return PatchResult(done.returncode == 0, _first_line(text))


def _patch_p1(root: Path, files: list[Path], check: bool, reverse: bool) -> PatchResult:
    # Exact context only (no fuzz), no .orig/.rej files left behind, and --forward: never take a
    # patch that looks already applied (or already reversed) the other way round.
    base = ["patch", "-p1", "--batch", "--silent", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
            "--reject-file=-", *(["--reverse"] if reverse else [])]
    for f in files:  # every file is checked before any is applied: all or nothing
        done = subprocess.run([*base, "--dry-run", "-i", str(f)], cwd=root, capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            return PatchResult(False, f"{f.name}: {_first_line(done.stdout + done.stderr)}")
    if not check:
        for f in files:
            done = subprocess.run([*base, "-i", str(f)], cwd=root, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return PatchResult(False, f"{f.name}: {_first_line(done.stdout + done.stderr)}")
    return PatchResult(True, "")


def apply(root: Path, files: list[Path], *, check: bool = False, reverse: bool = False) -> PatchResult:
    """Apply (or check, or reverse) all ``files`` in ``root``, all or nothing."""
    if shutil.which("git"):
        return _git_apply(root, files, check, reverse)
    if shutil.which("patch"):
        return _patch_p1(root, files, check, reverse)
    raise PatchError("neither git nor patch is installed", "install git")


DESCRIPTION = (
    "Patch a Megatron-LM checkout so that pretrain_gpt.py takes --extra-args-provider MOD:FUNC "
    "(repeatable, chained with its own provider) and arguments.py exposes --fused-single-qkv-rope "
    "(0.15+). Supported: " + ", ".join(name for _, name in PATCH_SETS) + ".")


def build_patch_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=prog, allow_abbrev=False, description=DESCRIPTION, message_prefix="")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``patch`` options, for this module's own parser and the ``megatron-perf-toggles patch`` subcommand."""
    parser.add_argument("--megatron", required=True, metavar="PATH", help="the Megatron-LM checkout to patch")
    parser.add_argument("--check", action="store_true", help="only say whether the patch set applies; change nothing")
    parser.add_argument("--reverse", action="store_true", help="take the patch set out again")
    parser.add_argument("--patch-set", metavar="NAME", help="use this patch set instead of the detected one")


def _say(text: str) -> None:
    print(f"{PREFIX} patch: {text}", flush=True)


def run(ns: argparse.Namespace) -> int:
    tree = inspect_tree(ns.megatron)
    name = ns.patch_set or patch_set_for(tree)
    directory = patches_dir()
    files = patch_files(directory, name)
    listed = ", ".join(f.name for f in files)
    what = f"Megatron-LM {tree.version} at {tree.root} (parses via {tree.family}); patch set {name} ({listed})"
    forward = apply(tree.root, files, check=True, reverse=ns.reverse)
    if forward.ok:
        if not ns.check:
            done = apply(tree.root, files, reverse=ns.reverse)
            if not done.ok:
                raise PatchError(f"{what}: applying failed after a clean check: {done.detail}")
        verb = ("would be taken out" if ns.reverse else "applies cleanly") if ns.check else (
            "taken out" if ns.reverse else "applied")
        _say(f"{what}: {verb}")
        return 0
    # Already in the state asked for? (applied when applying, absent when reversing.)
    if apply(tree.root, files, check=True, reverse=not ns.reverse).ok:
        _say(f"{what}: {'not applied' if ns.reverse else 'already applied'}; nothing to do")
        return 0
    raise PatchError(f"{what}: does not apply: {forward.detail}",
                     "a modified checkout? try --patch-set, or use python -m megatron_perf_toggles.run")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The ``patch`` subcommand; 0 when the tree ends up (or would end up) as asked, 2 otherwise."""
    try:
        ns = build_patch_parser(prog).parse_args(sys.argv[1:] if argv is None else list(argv))
        return run(ns)
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except PerfTogglesError as error:
        return report(error)


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m megatron_perf_toggles.tools.patching"))
