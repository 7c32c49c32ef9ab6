"""The runtime side of profiles: read the file MEGATRON_PERF_TOGGLES_PROFILE names, and say what
this run's environment is (as far as it is known when the toggles are decided) so that the core
can compare it with the one the profile was measured on.

Parsing and validation are the core's (``core.profile``); here is only what touches the machine:
the file, the environment variables of the launch, the planned target and an imported torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from ..core.facts import Capabilities
from ..core.profile import PROFILE_ENV, Environment, Observed, Profile, parse_profile
from ..errors import ProfileError
from .machine import target as planned
from .machine.capabilities import gpu_name_here

MAX_BYTES = 1 << 20  # a profile is a few kB; a larger file is the wrong file, not one to read whole


def load(path: str) -> Profile:
    """The profile at ``path``, or one ProfileError line (unreadable, too large, not UTF-8,
    malformed). A UTF-8 byte order mark, as some editors write, is accepted."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ProfileError(f"{PROFILE_ENV}={path}: larger than {MAX_BYTES // 1024} KiB, too large for a profile",
                               "is this the right file? tune writes a few kB")
        text = raw.decode("utf-8-sig")
    except OSError as error:
        raise ProfileError(f"{PROFILE_ENV}={path}: cannot read it ({error.strerror or error})",
                           "check the path, or unset the variable") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{PROFILE_ENV}={path}: not a UTF-8 text file",
                           "a profile is JSON, as tune writes it") from None
    # Errors name the path as given; the profile's source (reasons, the provenance record) is
    # absolute, since a record read later, elsewhere, must still say which file it was.
    return replace(parse_profile(text, path), source=os.path.abspath(path))


def _gpu(caps: Capabilities, mode: str, probe: bool = True,
         target: planned.Target | None = None) -> tuple[str | None, str | None]:
    """(name, None) where this run's GPU is known; (None, why) where it is not. ``probe``: whether
    asking torch for it is worth it (not where the profile recorded no GPU to compare with)."""
    source = caps.gpu_source or ""
    if caps.gpu_name and (source == "detected" or source.startswith("--gpu")):
        return caps.gpu_name, None
    if target is not None and target.gpu is not None:
        if target.gpu_source.startswith("--gpu"):
            return target.gpu.product, None
        return None, target.gpu_source or "the plan is for an assumed GPU"
    if mode != "plan" and probe:
        name = gpu_name_here()
        if name:
            return name, None
    return None, source or "no GPU is visible where the toggles are decided"


def _world_size(environ: Mapping[str, str], mode: str,
                target: planned.Target | None = None) -> tuple[int | None, str | None]:
    world = planned.planned_world(target, environ)
    if world is not None:
        return world, None
    if mode == "plan":
        return None, "explain plans for no particular world size (WORLD_SIZE is not set)"
    if mode == "doctor":
        return None, "doctor looks at this machine, not at a job's world size (WORLD_SIZE is not set)"
    return 1, None  # Megatron's own reading of an unset WORLD_SIZE


def observed(caps: Capabilities, environ: Mapping[str, str], mode: str, probe_gpu: bool = True,
             target: planned.Target | None = None) -> Observed:
    """This run's Megatron, TE, torch, GPU and world size, each known or with why it is not.

    In ``plan`` mode (explain) the TE and torch found are the planning machine's, often a laptop
    with neither matching the cluster: they are not checked unless TE is assumed (torch cannot
    be), so that no plan warns "measured elsewhere" about the machine it merely runs on. In
    ``doctor`` mode this machine is the point: its TE, torch and GPU are checked, and the world size
    only where WORLD_SIZE gives one."""
    unknown: dict[str, str] = {}
    if not caps.megatron.version:
        unknown["megatron"] = "Megatron's version could not be read"
    if caps.te_version == "unknown":
        unknown["transformer_engine"] = "Transformer Engine's version could not be read"
    elif mode == "plan" and not caps.is_assumed("te_version"):
        unknown["transformer_engine"] = "a plan sees the planning machine's, not the run's (assume te=VERSION)"
    if caps.torch_version is None and mode == "run":
        unknown["torch"] = "torch is not imported yet"
    elif caps.torch_version is None and mode == "doctor":
        unknown["torch"] = "torch is not installed here"
    elif mode == "plan":
        unknown["torch"] = "a plan sees the planning machine's, not the run's"
    gpu, why = _gpu(caps, mode, probe_gpu, target)
    if why:
        unknown["gpu"] = why
    world, why = _world_size(environ, mode, target)
    if why:
        unknown["world_size"] = why
    env = Environment(megatron=caps.megatron.version, transformer_engine=caps.te_version,
                      torch=caps.torch_version, gpu=gpu, world_size=world)
    return Observed(env, unknown)


def observed_for(profile: Profile | None, caps: Capabilities, environ: Mapping[str, str], mode: str,
                 target: planned.Target | None = None) -> Observed | None:
    """What a plan compares ``profile``'s environment with (None without a profile). With no GPU
    recorded there is nothing to compare, so torch is not asked for this machine's GPU. ``target``:
    the job planned for (its world and GPU), None for this machine."""
    if profile is None:
        return None
    return observed(caps, environ, mode, probe_gpu=profile.environment.gpu is not None, target=target)
