"""Adding a toggle is one registry entry, its guard rule(s), and their tests. This test is the walk-through.

It declares a toggle the package does not have, with the capability it needs, and one guard that
consults that need; everything else (the flags, the environment variable, ``--help``, the
decision and its provenance, the README table) must follow with no other code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import pytest
from conftest import full_caps

from megatron_perf_toggles.core import decide, guards, registry
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.errors import CannotHonourError, EnvValueError, RegistryError
from megatron_perf_toggles.runtime import provider
from megatron_perf_toggles.runtime.controller import Controller
from megatron_perf_toggles.tools import readme_tables

# 1. The registry entry. Flags follow from dest: --fused-example-kernel / --no-fused-example-kernel.
EXAMPLE = registry.Toggle(
    dest="fused_example_kernel",
    env="FUSED_EXAMPLE_KERNEL",
    title="fused example kernel",
    kind="bool",
    default=True,
    group="transformer",
    needs=("te_fused_qkv_rope",),
    help="An example of a fused kernel from Transformer Engine.",
)


# 2. Its guard, declared once: the toggle it may move (and the Megatron rules it answers: none here,
# it is about this machine); off where the kernel it needs is missing, naming the capability.
@decide.guard(moves=(EXAMPLE.dest,))
def example_kernel_missing(ctx: decide.Context) -> Iterator[decide.Change]:
    need = decide.lacking(ctx, EXAMPLE.dest) if ctx.values.get(EXAMPLE.dest) else None
    if need:
        yield decide.Change(EXAMPLE.dest, False, f"{need} is missing here", hint=f"pass {EXAMPLE.off_flag}",
                            capability=need)


@pytest.fixture
def with_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry appended to TOGGLES (and to every module's view of it), the guard to GUARDS."""
    replaced = [(registry.TOGGLES, (*registry.TOGGLES, EXAMPLE)),
                (registry.BY_DEST, {**registry.BY_DEST, EXAMPLE.dest: EXAMPLE})]
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron_perf_toggles"):
            for attr, value in list(vars(module).items()):
                new = next((n for old, n in replaced if value is old), None)
                if new is not None:
                    monkeypatch.setattr(module, attr, new)
    monkeypatch.setattr(decide, "GUARDS", (*decide.GUARDS, example_kernel_missing))
    assert example_kernel_missing.name == "example_kernel_missing"
    registry._validate()  # the declaration-time checks accept it


def _parse(argv: list[str], environ: dict[str, str], **caps: object) -> tuple[argparse.Namespace, Controller]:
    controller = Controller(environ, mode="plan", capabilities=full_caps(**caps))
    parser = provider.attach(argparse.ArgumentParser(prog="pretrain_gpt.py"), controller=controller)
    return parser.parse_args(argv), controller


def test_the_flags_and_the_variable_follow_from_the_entry(with_example: None) -> None:
    assert EXAMPLE.flags == ("--fused-example-kernel", "--no-fused-example-kernel")
    assert read_env({"FUSED_EXAMPLE_KERNEL": "off"}).toggles == {"fused_example_kernel": False}
    with pytest.raises(EnvValueError, match="FUSED_EXAMPLE_KERNEL"):
        read_env({"FUSED_EXAMPLE_KERNEL": "maybe"})
    parser = provider.attach(argparse.ArgumentParser(), environ={})
    assert {"--fused-example-kernel", "--no-fused-example-kernel"} <= set(parser._option_string_actions)
    assert "FUSED_EXAMPLE_KERNEL" in parser.format_help()


def test_the_decision_comes_from_command_line_environment_or_default(with_example: None) -> None:
    args, _ = _parse([], {})
    assert args.fused_example_kernel is True and args.perf_toggles["fused_example_kernel"]["source"] == "default"
    args, _ = _parse([], {"FUSED_EXAMPLE_KERNEL": "0"})
    assert args.perf_toggles["fused_example_kernel"] == {"value": False, "source": "env",
                                                         "reason": "FUSED_EXAMPLE_KERNEL=0",
                                                         "peak_memory_delta_mb": None}  # no term in core/memory.py
    args, _ = _parse(["--no-fused-example-kernel"], {"FUSED_EXAMPLE_KERNEL": "1"})
    assert args.perf_toggles["fused_example_kernel"]["source"] == "cli"


def test_the_guard_consults_what_the_registry_says_the_toggle_needs(with_example: None) -> None:
    args, controller = _parse([], {}, te_fused_qkv_rope=False)
    record = args.perf_toggles["fused_example_kernel"]
    assert (record["value"], record["source"]) == (False, "guard") and "te_fused_qkv_rope" in record["reason"]
    assert controller.last is not None and controller.last.plan.decisions["fused_example_kernel"].value is False
    with pytest.raises(CannotHonourError, match="--fused-example-kernel was requested"):
        decide.decide({}, {"fused_example_kernel": True}, read_env({}), full_caps(te_fused_qkv_rope=False))


def test_a_guard_cannot_rest_on_an_undeclared_capability() -> None:
    with pytest.raises(RegistryError, match="the registry does not declare"):
        decide.Change("fused_example_kernel", False, "why", capability="warp_drive")


def test_the_readme_table_lists_it(with_example: None) -> None:
    assert "`FUSED_EXAMPLE_KERNEL`" in readme_tables.toggles_table()


def test_the_guard_table_lists_its_guard(with_example: None) -> None:
    row = next(line for line in guards.guards_table(decide.GUARDS).splitlines() if "example_kernel_missing" in line)
    assert "`fused_example_kernel`" in row and "none" in row
