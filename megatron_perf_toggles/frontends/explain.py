"""``explain --bridge-recipe`` and ``explain --primus-config``: plan a config front end's job here.

The same pipeline as ``bridge.apply`` and Primus's patch, in ``plan`` mode, for the world and GPU
asked for (``--world-size``, ``--gpu``; the planned stack of that GPU, as the launcher's dry run
uses), on a machine with no GPU and no Transformer Engine: while the recipe or the experiment
file is built, Transformer Engine and triton are stood in for where they are missing
(``frontends.te_standin``, ``launcher.import_shims``), and Megatron sees the planned world and GPU
(``runtime.machine.target.stand_ins``). A recipe or file that cannot be built here is one line, exit 2.

- ``--bridge-recipe MODULE:FUNCTION [KEY=VALUE ...]``: the recipe function, called as
  ``bridge_recipe.build`` calls it (the fields it sets count as set), with the keyword arguments
  given after ``--`` (values read as Python literals, else strings).
- ``--primus-config FILE.yaml``: loaded by Primus's own ``load_primus_config`` from the checkout
  the file is in (else the importable ``primus``), and Megatron's namespace built by Primus's
  ``MegatronArgBuilder`` against ``--megatron PATH`` or ``--megatron-version NAME`` (a recorded
  surface; else the importable Megatron, else the checkout's ``third_party/Megatron-LM``, else the
  recorded surface of the Megatron-LM the checkout pins: ``primus_offline.served``). Primus's own
  ``build_args`` patches are not run.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.decision.decide import Plan
from ..core.facts import Capabilities
from ..errors import PerfTogglesError
from ..runtime.machine import target as planned
from ..runtime.process_changes import ProcessChanges


def add_options(parser: Any) -> None:
    """explain's front-end options."""
    group = parser.add_argument_group("plan a configuration front end's job instead of a command line")
    front = group.add_mutually_exclusive_group()
    front.add_argument("--bridge-recipe", metavar="MODULE:FUNCTION",
                       help="a Megatron-Bridge recipe function (e.g. megatron.bridge.recipes.llama:"
                       "llama3_8b_pretrain_config); its keyword arguments as KEY=VALUE after --")
    front.add_argument("--primus-config", metavar="FILE.yaml", help="a Primus experiment file (e.g. examples/megatron/"
                       "configs/MI355X/llama3.1_8B-BF16-pretrain.yaml); --megatron names the Megatron-LM it builds on")
    group.add_argument("--bridge-version", metavar="VERSION", help="with --bridge-recipe: plan from the package's "
                       "recorded catalog of this Megatron-Bridge version, installed or not (default, without Bridge: "
                       "the installed version's catalog, else the newest)")


def requested(ns: argparse.Namespace) -> str | None:
    """Which front end explain plans for, if any (``--bridge-version`` alone: one line)."""
    if getattr(ns, "bridge_version", None) and not getattr(ns, "bridge_recipe", None):
        raise PerfTogglesError("--bridge-version goes with --bridge-recipe MODULE:FUNCTION")
    if getattr(ns, "bridge_recipe", None):
        return "bridge"
    if getattr(ns, "primus_config", None):
        return "primus"
    return None


def command(ns: argparse.Namespace) -> list[str]:
    """What the record names as the job planned."""
    if requested(ns) == "bridge":
        return ["--bridge-recipe", ns.bridge_recipe, *ns.megatron_args]
    return ["--primus-config", ns.primus_config]


def plan(ns: argparse.Namespace, target: planned.Target) -> tuple[Plan, Capabilities, str, dict[str, Any]]:
    """The plan, its capabilities, a label for where Megatron's facts came from, and the arguments."""
    chatter = io.StringIO()  # the front end's own printing while it builds; the explanation is ours
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            if requested(ns) == "bridge":
                return _bridge(ns, target)
            return _primus(ns, target)
    except PerfTogglesError:
        raise
    except Exception as error:  # noqa: BLE001 - a job that cannot be built here is one line
        what = ns.bridge_recipe if requested(ns) == "bridge" else ns.primus_config
        text = " ".join(str(error).split())[:300] or "no message"
        raise PerfTogglesError(f"{what} cannot be built here: {type(error).__name__}: {text}",
                               "it needs what the front end itself imports (see docs/bridge.md, docs/primus.md)"
                               ) from None


def _keywords(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise PerfTogglesError(f"--bridge-recipe takes KEY=VALUE keyword arguments after --, not {pair!r}")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _check_keywords(spec: str, fn: Any, kwargs: dict[str, Any]) -> None:
    """A keyword the recipe function does not take is one line naming the one it most likely meant
    (the function would raise a TypeError that says nothing of what it takes)."""
    import inspect

    from ..errors import did_you_mean

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: the call itself will say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in named:
            takes = f"it takes: {', '.join(named)}" if named else "it takes none: change the configuration it builds"
            raise PerfTogglesError(f"--bridge-recipe {spec} takes no keyword argument {key!r}",
                                   f"{did_you_mean(key, named)}{takes}")


def _bridge(ns: argparse.Namespace, target: planned.Target) -> tuple[Plan, Capabilities, str, dict[str, Any]]:
    from ..launcher.import_shims import megatron_importable
    from ..runtime.machine.probe import installed
    from .bridge import adapter as bridge
    from .bridge import recipe as bridge_recipe
    from .te_standin import transformer_engine

    kwargs = _keywords(list(ns.megatron_args))
    module, _ = bridge_recipe.split(ns.bridge_recipe)  # a misspelt name or a missing Bridge: one line, at once
    if ns.bridge_version and not module.startswith("megatron.bridge"):
        raise PerfTogglesError(f"--bridge-version plans Megatron-Bridge's own recipes from its recorded catalog; "
                               f"{module} is not one of them")
    if module.startswith("megatron.bridge") and (ns.bridge_version or not installed("megatron.bridge")):
        from .bridge import catalog as bridge_catalog

        return bridge_catalog.plan(ns, target)  # the recorded catalog: no Bridge, torch or TE needed
    if not installed(module.partition(".")[0]) or (module.startswith("megatron.") and not installed("megatron.bridge")):
        raise PerfTogglesError(f"--bridge-recipe {ns.bridge_recipe}: {module} is not importable here",
                               "install Megatron-Bridge (pip install megatron-bridge) or run with its Python")
    # a plan for another machine never rests on this machine's TE: the stand-in serves it, whatever
    # is installed here (none, the empty meta package, a build that cannot load)
    with megatron_importable(ns.megatron), transformer_engine(planned.elsewhere(target)), planned.stand_ins(target):
        fn = bridge_recipe.resolve(ns.bridge_recipe)
        _check_keywords(ns.bridge_recipe, fn, kwargs)
        cfg = bridge_recipe.build(fn, **kwargs)
        result, caps, args = bridge.explain(cfg, target=target)
    version = getattr(sys.modules.get("megatron.bridge.package_info"), "__version__", "?")
    name = ns.bridge_recipe.replace(":", ".").rpartition(".")[2]
    return result, caps, f"Megatron-Bridge {version}, recipe {name}", args


def _primus_root(config: Path) -> Path | None:
    for parent in config.resolve().parents:
        if (parent / "primus" / "core" / "patches").is_dir():
            return parent
    return None


def _megatron_for(ns: argparse.Namespace, root: Path | None) -> str | None:
    if ns.megatron:
        return str(ns.megatron)
    from ..runtime.machine.probe import installed

    if installed("megatron.training"):
        return None
    bundled = root / "third_party" / "Megatron-LM" if root is not None else None
    if bundled is not None and (bundled / "megatron" / "training").is_dir():
        return str(bundled)
    raise PerfTogglesError("Primus builds Megatron's namespace from Megatron-LM's own parser, and none is here",
                           "pass --megatron /path/to/Megatron-LM")


def _primus_build_args(loaded: Any, module: Any, namespace: Any) -> None:
    """Primus's own ``build_args`` patches on the namespace, as its runtime runs them before the
    plugin's (which plans here instead of running): what they set, the plan sees."""
    import primus.backends.megatron.patches  # noqa: F401 - Primus's own patches register on import
    from primus.core.patches import run_patches
    from primus.core.patches.patch_registry import PatchRegistry
    from primus.core.runtime.logging import init_worker_logger

    from .primus.adapter import PATCH_ID

    scope = ProcessChanges()  # Primus's logger takes over print(): for this block only
    scope.set_attr(builtins, "print", builtins.print, "print (Primus's logger replaces it)")
    try:
        init_worker_logger(primus_config=loaded, module_name="pre_trainer", module_config=module)
        ids = [p.id for p in PatchRegistry.iter_patches(backend="megatron", phase="build_args")
               if p.id != PATCH_ID]
        run_patches(backend="megatron", phase="build_args", model_name=getattr(module, "model", None),
                    module_name="pre_trainer", enabled_ids=ids,
                    extra={"backend_args": namespace, "primus_config": loaded, "module_config": module,
                           "runtime_state": None})
    finally:
        scope.uninstall()


@contextlib.contextmanager
def _elsewhere() -> Iterator[None]:
    """Primus's loader makes its output directories under the working directory: a scratch one."""
    import tempfile

    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="perf-toggles-primus-") as scratch:
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(here)


def _primus_megatron(ns: argparse.Namespace, root: Path | None, target: planned.Target) -> tuple[Any, str]:
    """The Megatron Primus builds on (a block to run the build in) and, for a recorded surface, why it."""
    from ..launcher.import_shims import megatron_importable
    from .primus import offline as primus_offline

    if getattr(ns, "megatron_version", None):
        return primus_offline.recorded_megatron(ns.megatron_version), "as --megatron-version asks"
    try:
        return megatron_importable(_megatron_for(ns, root), elsewhere=planned.elsewhere(target)), ""
    except PerfTogglesError:  # no Megatron-LM here: Primus builds on a recorded surface's parser, its pin's
        name, why = primus_offline.served(root)
        return primus_offline.recorded_megatron(name), f"no Megatron-LM here; {why}"


def _primus(ns: argparse.Namespace, target: planned.Target) -> tuple[Plan, Capabilities, str, dict[str, Any]]:
    from .primus import adapter as primus

    config = Path(ns.primus_config).resolve()
    if not config.is_file():
        from ..errors import did_you_mean

        near = sorted(p.name for p in config.parent.glob("*.y*ml")) if config.parent.is_dir() else []
        close = did_you_mean(config.name, near).strip()
        raise PerfTogglesError(f"--primus-config {config}: no such file",
                               close or ("check the path" if not config.parent.is_dir() else
                                         f"{config.parent} holds no file of that name"))
    root = _primus_root(config)
    from ..runtime.machine.probe import installed

    if root is None and not installed("primus"):
        raise PerfTogglesError(f"--primus-config {config}: the file is in no Primus checkout and Primus is not "
                               "importable here", "pass a file inside a Primus checkout, or install Primus")
    from .primus import offline as primus_offline

    megatron, why = _primus_megatron(ns, root, target)
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    with megatron as surface, planned.stand_ins(target), _elsewhere():
        from primus.backends.megatron.argument_builder import MegatronArgBuilder
        from primus.core.config.primus_config import get_module_config, load_primus_config

        loaded = load_primus_config(config)
        module = get_module_config(loaded, "pre_trainer")
        namespace = MegatronArgBuilder().update(module.params).finalize()
        _primus_build_args(loaded, module, namespace)
        package = str(root / "primus") if root is not None else None
        recorded = primus_offline.capabilities(surface, target) if surface else None
        result, caps, args = primus.explain(namespace, primus.primus_defaults(package), target=target,
                                            capabilities=recorded)
    where = f" (recorded surface {surface['name']!r}: {why})" if surface else ""
    return result, caps, f"Primus, experiment {config.name}, Megatron-LM {caps.megatron.version}{where}", args

