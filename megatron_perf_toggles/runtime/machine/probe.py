"""Asking whether an optional package is here, without importing what need not be.

One place for "is it installed" (and at which version) and for "the torch this process has, or imports now": capability
detection, the planned machine of a dry run, the wgrad fallback and the launcher's import stand-ins
all ask the same questions.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def dist_version(*names: str) -> str | None:
    """The version of the first of ``names`` whose distribution is installed (None: none is)."""
    import importlib.metadata  # lazy: ~50 ms, and only needed when a package is actually there

    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed(module: str) -> bool:
    """Whether ``module`` can be found (its spec; nothing is imported but a parent package)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def import_failure(module: str) -> BaseException | None:
    """Why ``module``, installed here, does not import (None where it imports or is not installed).
    Transformer Engine's empty ``transformer-engine`` meta package, which ``pip install
    transformer-engine`` alone leaves, is installed and raises at import; so does a build for
    another CUDA."""
    if module in sys.modules or not installed(module):
        return None
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - whatever it raises, it cannot serve
        return error
    return None


def torch_module(import_it: bool = True) -> Any | None:
    """The torch this process has imported, else (with ``import_it``) torch imported now; None where
    it is not installed or does not import."""
    torch = sys.modules.get("torch")
    if torch is not None or not import_it or not installed("torch"):
        return torch
    try:
        return importlib.import_module("torch")
    except Exception:  # noqa: BLE001 - a torch that does not import is as good as none here
        return None


# Where Linux shows a GPU that torch could use, or a driver that would load for one: NVIDIA's device
# nodes (/dev/nvidiactl, /dev/nvidia0), its loaded driver (/proc/driver/nvidia, /sys/module/nvidia)
# and its loader (nvidia-modprobe: a server's nodes and module may appear only when CUDA first asks),
# Jetson's integrated GPU (/sys/module/nvgpu, /dev/nvhost-ctrl-gpu, /dev/nvmap), WSL's GPU bridge
# (/dev/dxg), and AMD's driver (/dev/kfd, /sys/class/kfd, /sys/module/amdgpu). Any sign: torch is asked.
GPU_SIGNS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/sys/module/nvidia", "/usr/bin/nvidia-modprobe",
             "/sys/module/nvgpu", "/dev/nvhost-ctrl-gpu", "/dev/nvmap", "/dev/dxg", "/dev/kfd", "/sys/class/kfd",
             "/sys/module/amdgpu")


def no_gpu_here() -> bool:
    """True where no GPU can be visible to torch whatever it is: a Linux machine with no sign of a
    CUDA or ROCm driver (a laptop, a CI runner). Importing torch costs about 2 s, which a plan on
    such a machine need not pay to learn that ``torch.cuda.is_available()`` is False. False (ask
    torch) where any sign is there, or on another system."""
    if not sys.platform.startswith("linux"):
        return False
    return not any(os.path.exists(sign) for sign in GPU_SIGNS)


def gpu_question_without_torch() -> bool:
    """Whether a question about this machine's GPU is answered "none" without torch: torch is not
    imported yet (an imported one is asked, it knows) and no GPU can be visible (``no_gpu_here``)."""
    return "torch" not in sys.modules and no_gpu_here()


def torch_build() -> dict[str, str | None] | None:
    """The installed torch's ``__version__``, ``cuda`` and ``hip`` (``torch/version.py``, which its
    build writes as plain assignments), read without importing torch; None where torch is not
    installed or the file cannot be read that way."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    try:
        tree = ast.parse(Path(locations[0], "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, assigned = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, assigned = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("__version__", "cuda", "hip"):
            try:
                value = ast.literal_eval(assigned)
            except ValueError:
                return None
            found[target.id] = value if value is None else str(value)
    return found if "__version__" in found else None
