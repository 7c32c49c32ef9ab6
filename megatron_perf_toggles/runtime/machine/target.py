"""The job a dry run plans for: how many ranks, and which GPU, answered without touching a GPU.

Megatron's ``parse_args`` reads the world from ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``, and
``validate_args`` asks the device what it is: ``get_device_arch_version()`` (which reads
``torch.cuda.get_device_properties(0).major``) once tensor or context parallelism is on, and
``torch.cuda.get_device_capability()`` for grouped GEMMs. On a laptop those questions fail ("world
size (1) is not divisible", "Found no NVIDIA driver"). A dry run therefore takes the world and GPU it
plans for (``--world-size`` or ``--nnodes`` x ``--nproc-per-node``, ``--gpu h100|...|sm_90|gfx942``)
and answers those questions from the small table below for the length of Megatron's parse and
validate, and no longer.

One owner undoes everything: a scoped :class:`~.process_changes.ProcessChanges` records each attribute and
environment variable replaced and puts every one back, in reverse order, when the ``with`` block
ends, however it ends (a dry run ends in ``SystemExit``). Nothing here imports torch or Megatron at module import time.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ...errors import PerfTogglesError, did_you_mean
from ..process_changes import ProcessChanges
from .probe import gpu_question_without_torch, torch_module


@dataclass(frozen=True, slots=True)
class Gpu:
    """The facts about one GPU that Megatron's argument checks and the plugin's guards ask for."""

    name: str  # h100, or the arch itself for a bare arch (sm_90)
    vendor: str  # cuda | rocm
    arch: str  # sm_90 | gfx942: what torch reports (gcnArchName on ROCm)
    capability: tuple[int, int]  # torch.cuda.get_device_capability(): (9, 0) on Hopper, (9, 4) on gfx942
    product: str  # torch.cuda.get_device_name()
    memory_gib: float  # what torch reports as the device's total memory, where measured; else the product's size
    multiprocessors: int


# Public specifications of each product (compute capability, memory, SMs / CUs).
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("h100", "cuda", "sm_90", (9, 0), "NVIDIA H100 80GB HBM3", 80, 132),
    Gpu("h200", "cuda", "sm_90", (9, 0), "NVIDIA H200", 139.8, 132),  # torch: 143,156 MB (sold as 141 GB)
    Gpu("b200", "cuda", "sm_100", (10, 0), "NVIDIA B200", 180, 148),
    Gpu("mi300x", "rocm", "gfx942", (9, 4), "AMD Instinct MI300X", 192, 304),
    Gpu("mi355x", "rocm", "gfx950", (9, 5), "AMD Instinct MI355X", 288, 256),
)}
# AMD architectures torch reports on ROCm, with the (major, minor) it gives for them.
ROCM_ARCHS = {"gfx90a": (9, 0), "gfx942": (9, 4), "gfx950": (9, 5)}
DEFAULT_GPU = {"cuda": "h100", "rocm": "mi300x"}  # planned for when no GPU is visible and none is named
PLAN_ENV = "MEGATRON_PERF_TOGGLES_PLAN"  # registered in core.registry.SETTINGS
# How each command that plans names the job's world and GPU: explain's options; the launcher's
# (which go before the training script, and which MEGATRON_PERF_TOGGLES_PLAN also sets, as under
# torchrun); a patched checkout's script, which has only the variable.
NAMING = {
    "explain": ("--world-size N", "--gpu"),
    "launcher": ("--world-size N", f"--gpu NAME before the script (or {PLAN_ENV}=:NAME)"),
    "script": (f"{PLAN_ENV}=N:GPU", f"{PLAN_ENV}=:NAME"),
}


class TargetError(PerfTogglesError):
    """A --world-size / --nnodes / --nproc-per-node / --gpu value that cannot be planned for."""


def gpu_named(text: str) -> Gpu:
    """``h100`` (a product in GPUS), ``sm_90`` / ``sm_100`` (a CUDA arch) or ``gfx942`` (a ROCm arch)."""
    word = text.strip().lower()
    if word in GPUS:
        return GPUS[word]
    for gpu in GPUS.values():  # an arch that names one product exactly: take its facts
        if gpu.arch == word and sum(g.arch == word for g in GPUS.values()) == 1:
            return gpu
    match = re.fullmatch(r"sm_?(\d+)(\d)", word)
    if match:
        major, minor = int(match.group(1)), int(match.group(2))
        return Gpu(f"sm_{major}{minor}", "cuda", f"sm_{major}{minor}", (major, minor), f"CUDA sm_{major}{minor}", 80, 132)
    if word in ROCM_ARCHS:
        return Gpu(word, "rocm", word, ROCM_ARCHS[word], f"AMD {word}", 192, 304)
    known = [*GPUS, *ROCM_ARCHS]
    raise TargetError(f"--gpu {text!r} is not a GPU this plugin knows",
                      f"{did_you_mean(word, known)}accepted: {', '.join(GPUS)}, sm_XY (e.g. sm_90), "
                      f"{', '.join(ROCM_ARCHS)}")


@dataclass(frozen=True, slots=True)
class Target:
    """What a dry run plans for. ``None`` fields keep this machine's own answer."""

    world_size: int | None = None
    per_node: int | None = None
    gpu: Gpu | None = None
    gpu_source: str = ""  # "--gpu h100", "no GPU visible: planned for h100", ...
    world_source: str = ""
    entry: str = "explain"  # whose command names the job: explain, launcher or script (NAMING)

    def how_gpu(self) -> str:
        """How the command this plan came from names another GPU."""
        return NAMING[self.entry][1]

    def how_world(self, environ: Mapping[str, str]) -> str:
        """How the command this plan came from names another world (torchrun's own options, for
        a launch whose world torchrun set in ``WORLD_SIZE``)."""
        if self.world_size is None and self.entry != "explain" and "WORLD_SIZE" in environ:
            return "torchrun's --nnodes x --nproc-per-node"
        return NAMING[self.entry][0]

    def to_record(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "nproc_per_node": self.per_node, "world_source": self.world_source or None,
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "vendor": self.gpu.vendor,
                                                  "arch": self.gpu.arch, "capability": list(self.gpu.capability)},
            "gpu_source": self.gpu_source or None,
        }


def _positive(flag: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise TargetError(f"{flag} {value}: must be at least 1")
    return value


def _visible_gpu() -> bool:
    if gpu_question_without_torch():  # no sign of a GPU driver: none, without importing torch
        return False
    torch = torch_module()
    if torch is None:  # no torch: no GPU either
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def make_target(world_size: int | None = None, nnodes: int | None = None, nproc_per_node: int | None = None,
                gpu: str | None = None, assumed_device: str | None = None,
                gpu_visible: bool | None = None, entry: str = "explain") -> Target:
    """The target from the command-line options. With none given on a GPU box, the real world and
    GPU stand; on a machine with no visible GPU, one is planned for (``DEFAULT_GPU``) and said so,
    with how ``entry``'s command (``NAMING``) names another."""
    _positive("--world-size", world_size)
    _positive("--nnodes", nnodes)
    _positive("--nproc-per-node", nproc_per_node)
    size, per_node, world_source = None, nproc_per_node, ""
    if nnodes is not None and nproc_per_node is None:
        raise TargetError(f"--nnodes {nnodes} needs --nproc-per-node (GPUs per node)", "or give --world-size")
    if nproc_per_node is not None:
        derived = (nnodes or 1) * nproc_per_node
        if world_size is not None and world_size != derived:
            raise TargetError(f"--world-size {world_size} contradicts --nnodes {nnodes or 1} x --nproc-per-node "
                              f"{nproc_per_node} = {derived}", "give one or the other")
        size, world_source = derived, f"--nnodes {nnodes or 1} x --nproc-per-node {nproc_per_node}"
    elif world_size is not None:
        size, world_source = world_size, f"--world-size {world_size}"
    chosen: Gpu | None = None
    gpu_source = ""
    if gpu is not None:
        chosen, gpu_source = gpu_named(gpu), f"--gpu {gpu}"
    elif not (_visible_gpu() if gpu_visible is None else gpu_visible):
        chosen = GPUS[DEFAULT_GPU.get(assumed_device or "", "h100")]
        gpu_source = f"no GPU visible here; {NAMING[entry][1]} picks another"
    return Target(world_size=size, per_node=per_node, gpu=chosen, gpu_source=gpu_source, world_source=world_source,
                  entry=entry)


OPTION_DESTS = ("world_size", "nnodes", "nproc_per_node", "gpu")


def parse_plan(text: str) -> tuple[int | None, str | None]:
    """``MEGATRON_PERF_TOGGLES_PLAN``: ``WORLD:GPU`` (``64:h100``), ``WORLD`` (``64``) or ``:GPU``
    (``:mi355x``). The one variable that names the job a patched checkout's dry run plans for,
    as the launcher's ``--world-size`` and ``--gpu`` do."""
    world_text, _, gpu_text = text.strip().partition(":")
    world: int | None = None
    if world_text.strip():
        try:
            world = int(world_text)
        except ValueError:
            raise TargetError(f"{PLAN_ENV}={text!r}: the world size {world_text.strip()!r} is not a whole number",
                              "write WORLD:GPU, e.g. 64:h100") from None
        if world < 1:
            raise TargetError(f"{PLAN_ENV}={text!r}: the world size must be at least 1", "e.g. 64:h100")
    gpu = gpu_text.strip() or None
    if gpu is not None:
        try:
            gpu_named(gpu)  # an unknown GPU is one line here, before anything is imported
        except TargetError as error:
            raise TargetError(f"{PLAN_ENV}={text!r}: {error.message.removeprefix('--gpu ')}", error.hint) from None
    return world, gpu


def from_environment(environ: Mapping[str, str] | None = None, entry: str = "script") -> Target:
    """The target ``MEGATRON_PERF_TOGGLES_PLAN`` names (unset: this machine, as with no options),
    for ``entry``'s command (a patched checkout's script, unless the launcher or explain asks)."""
    from ...core.env import read_text_setting
    from .assume import assumed_device

    text = read_text_setting(PLAN_ENV, os.environ if environ is None else environ)
    world, gpu = parse_plan(text) if text else (None, None)
    target = make_target(world, None, None, gpu, assumed_device(), entry=entry)
    if not text:
        return target
    return replace(target, world_source=f"{PLAN_ENV}={text}" if world is not None else "",
                   gpu_source=f"{PLAN_ENV}={text}" if gpu is not None else target.gpu_source)


def planned_world(target: Target | None, environ: Mapping[str, str]) -> int | None:
    """The world Megatron's ``parse_args`` will see: a planned target's, else ``WORLD_SIZE`` as
    torchrun sets it; None where neither says."""
    if target is not None and target.world_size is not None:
        return target.world_size
    raw = (environ.get("WORLD_SIZE") or "").strip()
    return int(raw) if raw.isdigit() else None


def add_options(group: Any) -> None:
    """The planning options, declared once for the launcher's dry run and for ``explain``."""
    group.add_argument("--world-size", type=int, metavar="N", help="ranks in the job (default: WORLD_SIZE, else 1)")
    group.add_argument("--nnodes", type=int, metavar="N", help="nodes; with --nproc-per-node, instead of --world-size")
    group.add_argument("--nproc-per-node", type=int, metavar="N", help="GPUs per node")
    group.add_argument("--gpu", metavar="NAME", help=f"{', '.join(GPUS)}, or an arch (sm_90, sm_100, gfx942, gfx950); "
                       f"default: the visible GPU, else {DEFAULT_GPU['cuda']} ({DEFAULT_GPU['rocm']} with "
                       "MEGATRON_PERF_TOGGLES_ASSUME=rocm)")


def from_options(ns: Any, environ: Mapping[str, str] | None = None, entry: str = "explain") -> Target:
    """The target the parsed planning options (``add_options``) of ``entry``'s command ask for;
    with none given, the one ``MEGATRON_PERF_TOGGLES_PLAN`` names, so the launcher and a patched
    checkout plan alike."""
    from .assume import assumed_device

    if all(getattr(ns, name, None) is None for name in OPTION_DESTS):
        return from_environment(environ, entry)
    return make_target(ns.world_size, ns.nnodes, ns.nproc_per_node, ns.gpu, assumed_device(), entry=entry)


def elsewhere(target: Target | None) -> bool:
    """Whether a plan is for another machine than this one: it names a GPU (``--gpu``), or none is
    visible here, so the plan is for one from the table (``--world-size`` / ``--nnodes`` on a
    laptop). Only then does the planned stack replace detection. A world named on a GPU machine
    (ablate's dry runs for its own multi-GPU runs) keeps this machine's GPU and software."""
    return target is not None and target.gpu is not None


class _Properties:
    """What ``torch.cuda.get_device_properties`` returns, for the planned GPU."""

    def __init__(self, gpu: Gpu) -> None:
        self.name = gpu.product
        self.major, self.minor = gpu.capability
        self.total_memory = int(gpu.memory_gib * 2**30)
        self.multi_processor_count = gpu.multiprocessors
        self.gcnArchName = gpu.arch if gpu.vendor == "rocm" else ""
        self.is_integrated = False

    def __repr__(self) -> str:
        return f"_Properties(name={self.name!r}, major={self.major}, minor={self.minor}, planned)"


def _world(stand: ProcessChanges, target: Target) -> None:
    if target.world_size is None:
        return
    stand.set_item(os.environ, "WORLD_SIZE", str(target.world_size))
    stand.set_item(os.environ, "RANK", "0")  # rank 0 plans (and prints) for the job
    stand.set_item(os.environ, "LOCAL_RANK", "0")
    stand.set_item(os.environ, "LOCAL_WORLD_SIZE", str(target.per_node or min(target.world_size, 8)))


def _device(stand: ProcessChanges, gpu: Gpu, count: int) -> None:
    """Answer torch's device questions for ``gpu``. Without torch there is nobody to ask them:
    planning on a machine with no torch reads the GPU's facts from the table alone."""
    import importlib

    try:
        torch: Any = importlib.import_module("torch")
    except ImportError:
        return

    props = _Properties(gpu)
    cuda = torch.cuda
    stand.set_attr(cuda, "is_available", lambda: True)
    stand.set_attr(cuda, "device_count", lambda: count)
    stand.set_attr(cuda, "current_device", lambda: 0)
    stand.set_attr(cuda, "get_device_capability", lambda device=None: gpu.capability)
    stand.set_attr(cuda, "get_device_properties", lambda device=None: props)
    stand.set_attr(cuda, "get_device_name", lambda device=None: gpu.product)
    # torch.version tells CUDA from ROCm builds (Megatron's and TE's ROCm probes read .hip).
    stand.set_attr(torch.version, "hip", "6.4.0-planned" if gpu.vendor == "rocm" else None)
    stand.set_attr(torch.version, "cuda", "12.8-planned" if gpu.vendor == "cuda" else None)


def _te_version(stand: ProcessChanges, te_version: str | None) -> None:
    """Megatron caches Transformer Engine's version in ``megatron.core.utils._te_version``; a
    planned TE (``MEGATRON_PERF_TOGGLES_ASSUME=te=VERSION``) answers its ``is_te_min_version``."""
    utils = sys.modules.get("megatron.core.utils")
    if te_version is None or utils is None or "_te_version" not in vars(utils):
        return
    try:
        from packaging.version import Version

        stand.set_attr(utils, "_te_version", Version(te_version))
    except Exception:  # noqa: BLE001 - packaging absent or an odd version: Megatron's own answer stands
        return


@contextmanager
def stand_ins(target: Target | None, te_version: str | None = None, megatron: bool = True
              ) -> Iterator[Target | None]:
    """Within this block Megatron sees ``target``'s world and GPU; afterwards, this machine again.
    The plugin's own code is never told through here: the target is passed to it (the run context's
    ``target``, capabilities.for_plan, profile_file.observed). ``megatron=False``: no Megatron code
    runs in the block (a plan on a recorded surface), so torch, which only Megatron would ask about
    the GPU, is not imported (about 2 s) to be told."""
    stand = ProcessChanges()  # scoped: undone when the block ends, however it ends
    try:
        if target is not None:
            _world(stand, target)
            if target.gpu is not None and (megatron or "torch" in sys.modules):
                _device(stand, target.gpu, target.per_node or min(target.world_size or 1, 8))
        _te_version(stand, te_version)
        yield target
    finally:
        stand.uninstall()


def describe(target: Target | None, environ: Mapping[str, str] | None = None) -> str:
    """One line for people: the world and GPU a plan is for, and where each came from."""
    environ = os.environ if environ is None else environ
    if target is None or target.world_size is None:
        world = f"world {environ.get('WORLD_SIZE', '1')} (from {'WORLD_SIZE' if 'WORLD_SIZE' in environ else 'default'})"
    else:
        world = f"world {target.world_size} ({target.world_source})"
    if target is None or target.gpu is None:
        gpu = "this machine's GPU (detected)"
    else:
        gpu = f"{target.gpu.name} {target.gpu.arch} ({target.gpu_source})"
    return f"{world}, {gpu}"
