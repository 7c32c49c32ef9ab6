"""Plan a Primus experiment file where Megatron-LM is not installed: a recorded Megatron surface
stands in for ``megatron.training.arguments``, and torch for Primus's imports.

Primus builds Megatron's namespace with Megatron's own argument definitions; without Megatron-LM,
a recorded surface gives them, and the plan takes that surface's Megatron facts: the surface of the
Megatron-LM commit Primus pins (:func:`served`), found from the checkout's gitlink of
``third_party/Megatron-LM`` (``git``), else from the package's table of known Primus commits and
versions (``data/primus_pins.json``; the checkout's commit read from ``.git`` without ``git``, else
``primus.__version__``), else the newest recorded release, and the plan says which and why.

Primus's Megatron backend also imports torch at module level in its patch modules, though
building the namespace from YAML runs none of it: on a laptop without torch
(``pip install 'megatron-perf-toggles[primus]'``) any ``torch.*`` module is made on demand for the
length of the build, with the placeholders of Transformer Engine's stand-in (``te_standin``), and
taken out of ``sys.modules`` again when the block ends, so that nothing after it (the plugin's own
probes included) takes it for an installed torch. Nothing of it reaches the decisions: a plan's
capabilities come from the planned stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from ...core.facts import Capabilities, megatron_facts_from_surface, version_tuple
from ...runtime import surface_replay as replay
from ...runtime.machine import target as planned
from ...runtime.process_changes import ProcessChanges
from .. import adapter as frontend
from ..te_standin import stand_in

PACKAGE = "torch"
VERSION = "0.0.0+planning-stand-in"


def torch_if_missing() -> AbstractContextManager[bool]:
    """Within the block, ``import torch...`` works where torch is not installed (yields whether the
    stand-in is in place); afterwards neither the finder nor any stand-in module is left."""
    return stand_in(PACKAGE, VERSION, forget=True)


def _arguments_module(surface: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType("megatron.training.arguments", f"Megatron's arguments, recorded ({surface['name']})")

    def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        recorded = replay.parser_from_surface(surface)
        for action in recorded._actions:
            if not isinstance(action, argparse._HelpAction):
                parser._add_action(action)
        return parser

    module.add_megatron_arguments = add_megatron_arguments  # type: ignore[attr-defined]
    module.__file__ = None
    return module


@contextmanager
def recorded_megatron(name: str) -> Iterator[dict[str, Any]]:
    """Within this block ``megatron.training.arguments`` is the recorded surface ``name``'s stand-in."""
    surface = replay.load_surface(name)
    stand = ProcessChanges()
    package = types.ModuleType("megatron", "stand-in: a recorded Megatron surface")
    training = types.ModuleType("megatron.training", "stand-in: a recorded Megatron surface")
    package.__path__ = []
    training.__path__ = []
    arguments = _arguments_module(surface)
    training.arguments = arguments  # type: ignore[attr-defined]
    package.training = training  # type: ignore[attr-defined]
    try:
        for module in (package, training, arguments):
            stand.set_item(sys.modules, module.__name__, module, f"stand-in {module.__name__}")
        with torch_if_missing():  # Primus's patch modules import torch, which building the namespace never runs
            yield surface
    finally:
        stand.uninstall()


def capabilities(surface: dict[str, Any], target: planned.Target) -> Capabilities:
    """The planned machine's capabilities with the recorded surface's Megatron facts."""
    caps = frontend.capabilities(frontend.read_env(os.environ), target)
    return dataclasses.replace(caps, megatron=megatron_facts_from_surface(surface))


SUBMODULE = "third_party/Megatron-LM"


def _gitlink(root: Path) -> str | None:
    """The commit the checkout's HEAD records for its Megatron submodule (None: no git, not a checkout)."""
    git = shutil.which("git")
    if git is None or not (root / ".git").exists():
        return None
    try:
        done = subprocess.run([git, "-C", str(root), "rev-parse", f"HEAD:{SUBMODULE}"], capture_output=True,
                              text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else None


def _head(root: Path) -> str | None:
    """The checkout's commit, read from ``.git`` itself (where ``git`` is not installed)."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = (root / git.read_text().partition("gitdir:")[2].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[len("ref: "):]
        common = git / "commondir"
        bases = [git, (git / common.read_text().strip()).resolve()] if common.is_file() else [git]
        for base in bases:
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        return None
    return None


def _version(root: Path) -> str | None:
    """``primus.__version__`` as the checkout's ``primus/__init__.py`` writes it (read, not imported)."""
    try:
        text = (root / "primus" / "__init__.py").read_text(encoding="utf-8")
    except OSError:
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def pinned(root: Path | None) -> tuple[str | None, str]:
    """The Megatron-LM commit the Primus checkout ``root`` pins, and how it was found (or why not)."""
    if root is None:
        return None, "the file is in no Primus checkout"
    sha = _gitlink(root)
    if sha:
        return sha, f"the checkout's {SUBMODULE} gitlink"
    table = json.loads((resources.files("megatron_perf_toggles") / "data" / "primus_pins.json").read_text())
    head = _head(root)
    if head is not None and head in table["commits"]:
        return table["commits"][head], f"Primus {head[:8]}, as recorded"
    version = _version(root)
    if version in table["versions"]:
        return table["versions"][version], f"Primus {version}, as recorded"
    return None, f"Primus {version or '(no version)'} is not in the package's recorded pins"


def served(root: Path | None) -> tuple[str, str]:
    """The recorded surface Primus's namespace is built on where no Megatron-LM is here, and why."""
    sha, how = pinned(root)
    commits = replay.commits()
    if sha and sha in commits:
        return commits[sha], f"Megatron-LM {sha[:8]}, the commit Primus pins ({how})"
    releases = [n for n in replay.available() if n.startswith("core_v")]
    newest = max(releases, key=lambda n: version_tuple(n.removeprefix("core_v")))
    why = f"Primus pins Megatron-LM {sha[:8]} ({how}), which is not recorded" if sha else how
    return newest, f"{why}: the newest recorded release instead"
